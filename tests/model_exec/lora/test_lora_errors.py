"""Adapters a rank cannot serve are refused with a LoRAError naming the adapter and the cause, and the rank's
adapters stay as they were; the rank's add / remove / list API (Worker's, over its shard's LoRAManager)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from model_exec.lora.manager import LoRAManager
from request.lora import LoRAError, LoRARequest
from tests.helpers.family_parity import PREFILL_PROMPTS, assert_logits_match
from tests.helpers.lora_models import hf_merged_model, make_peft_adapter, our_lora_prefill_logits
from tests.helpers.tiny_models import hf_prefill_logits, load_our_model, make_tiny_llama

WEIGHTS = "adapter_model.safetensors"
DOWN_1 = "base_model.model.model.layers.1.mlp.down_proj"


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, str]:
    root = tmp_path_factory.mktemp("lora-errors")
    model = make_tiny_llama(root)
    return root, model, make_peft_adapter(model, root / "good", rank=8, seed=1)


def _variant(
    good: str,
    out: Path,
    tensors: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None,
    config: Callable[[dict[str, object]], None] | None = None,
) -> str:
    """A copy of the adapter at `good` with its tensors and/or adapter_config.json rewritten."""
    shutil.copytree(good, out)
    if tensors is not None:
        save_file(tensors(load_file(out / WEIGHTS)), out / WEIGHTS)
    if config is not None:
        raw = json.loads((out / "adapter_config.json").read_text())
        config(raw)
        (out / "adapter_config.json").write_text(json.dumps(raw))
    return str(out)


def _without(*names: str) -> Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    return lambda t: {k: v for k, v in t.items() if k not in names}


def _snapshot(manager: LoRAManager) -> dict[str, dict[int, int]]:
    """Which weight objects each layer holds, by adapter id (identity: nothing rebuilt or swapped)."""
    return {
        name: {lora_id: id(w) for lora_id, w in layer.lora.adapters.items()}
        for name, layer in manager.layers.items()
        if layer.lora is not None
    }


def _broken_adapters(root: Path, model: str, good: str) -> list[tuple[str, str]]:
    """(adapter dir, what the error must say) for each way an adapter can fail on the rank."""
    other = make_tiny_llama(root / "wider", intermediate_size=96)
    renamed_qkv = {
        f"base_model.model.model.layers.{i}.self_attn.qkv_proj.lora_{ab}.weight": torch.zeros(s)
        for i in range(2)
        for ab, s in (("A", (8, 64)), ("B", (128, 8)))
    }
    experts = {
        "base_model.model.model.layers.0.mlp.experts.0.down_proj.lora_A.weight": torch.zeros(8, 128),
        "base_model.model.model.layers.0.mlp.experts.0.down_proj.lora_B.weight": torch.zeros(64, 8),
    }
    down_0 = "model.layers.0.mlp.down_proj"
    return [
        (good, "rank 8 is over max_lora_rank=4"),  # loaded with max_lora_rank=4
        (
            _variant(good, root / "missing", _without(f"{DOWN_1}.lora_A.weight", f"{DOWN_1}.lora_B.weight")),
            "no weights for model.layers.1.mlp.down_proj",
        ),
        (_variant(good, root / "half", _without(f"{DOWN_1}.lora_B.weight")), "layers.1.mlp.down_proj' has no lora_B"),
        (
            make_peft_adapter(other, root / "wider-adapter", seed=1),
            rf"{down_0}.lora_A has shape \(8, 96\), but the model's {down_0} needs \(8, 128\)",
        ),
        (
            _variant(good, root / "fused", lambda t: renamed_qkv, lambda c: c.update(target_modules=["qkv_proj"])),
            "no module named qkv_proj",
        ),
        (_variant(good, root / "experts", lambda t: {**t, **experts}), "inside a MoE layer's experts"),
        (
            _variant(good, root / "embed", config=lambda c: c.update(target_modules=["q_proj", "embed_tokens"])),
            "cannot adapt embed_tokens",
        ),
        (
            _variant(good, root / "extra", config=lambda c: c.update(target_modules=["q_proj", "k_proj", "v_proj"])),
            "weights for model.layers.0.mlp.down_proj, but target_modules does not name it",
        ),
        (
            _variant(good, root / "junk", lambda t: {**t, "base_model.model.lm_head.weight": torch.zeros(2, 2)}),
            "'base_model.model.lm_head.weight' is not a LoRA A or B matrix",
        ),
    ]


def test_bad_adapters_are_refused_by_name_and_change_nothing(setup: tuple[Path, str, str]) -> None:
    root, model, good = setup
    net, config = load_our_model(model)
    manager = LoRAManager(net, max_loras=1, max_lora_rank=16)  # type: ignore[arg-type]
    manager.add(LoRARequest("good", 1, good))
    before = _snapshot(manager)
    for i, (path, message) in enumerate(_broken_adapters(root, model, good)):
        manager.max_lora_rank = 4 if i == 0 else 16
        for lora_id in (1, 2):  # replacing the loaded adapter, or adding a new one
            with pytest.raises(LoRAError, match=message) as err:
                manager.add(LoRARequest("bad-one", lora_id, path))
            assert "'bad-one'" in str(err.value)
        assert manager.lora_ids() == [1]
        assert _snapshot(manager) == before
    # the good adapter still gives HF-merged's logits
    ours = our_lora_prefill_logits(net, manager, config, PREFILL_PROMPTS, [1] * len(PREFILL_PROMPTS))
    assert_logits_match(ours, hf_prefill_logits(hf_merged_model(model, good), PREFILL_PROMPTS))


def test_rank_add_remove_list(setup: tuple[Path, str, str], tmp_path: Path) -> None:
    from cluster.config import EngineConfig
    from cluster.engine import resolve_config
    from cluster.worker import Worker
    from model_exec.source import read_model_config, resolve_model

    root, model, good = setup
    other = make_peft_adapter(model, tmp_path / "other", rank=4, seed=5, targets=("q_proj", "v_proj"))
    model_config = read_model_config(resolve_model(model))

    def shard(enable_lora: bool) -> Worker:
        config = EngineConfig(
            model=model, device="cpu", dtype="float32", attention_backend="torch", block_size=4,
            enable_lora=enable_lora, max_loras=2,
        )  # fmt: skip
        worker = Worker(resolve_config(config, model_config), model_config)
        worker.load_model()
        return worker

    rank = shard(enable_lora=True)
    assert rank.list_loras() == []
    rank.add_lora(LoRARequest("other", 7, other))
    rank.add_lora(LoRARequest("good", 3, good))
    assert rank.list_loras() == [3, 7]
    rank.add_lora(LoRARequest("good-again", 7, good))  # an id already loaded is replaced
    assert rank.shard is not None and rank.shard.lora is not None
    o_proj = rank.shard.lora.layers["model.layers.0.self_attn.o_proj"].lora
    assert o_proj is not None and 7 in o_proj.adapters  # `other` had no o_proj; `good` has
    assert rank.remove_lora(7) is True and rank.remove_lora(7) is False
    assert rank.list_loras() == [3] and 7 not in o_proj.adapters
    rank.shutdown()

    plain = shard(enable_lora=False)
    with pytest.raises(LoRAError, match="'good'.*without enable_lora"):
        plain.add_lora(LoRARequest("good", 1, good))
    assert plain.list_loras() == [] and plain.remove_lora(1) is False
    plain.shutdown()


def test_bin_weights_load_and_a_corrupt_file_is_refused(setup: tuple[Path, str, str], tmp_path: Path) -> None:
    """adapter_model.bin (torch.save, read with weights_only) loads as the safetensors file does; a file that
    cannot be read is a LoRAError naming the adapter and the file."""
    _, model, good = setup
    as_bin = tmp_path / "bin"
    shutil.copytree(good, as_bin)
    torch.save(load_file(as_bin / WEIGHTS), as_bin / "adapter_model.bin")
    (as_bin / WEIGHTS).unlink()
    net, config = load_our_model(model)
    manager = LoRAManager(net, max_loras=1, max_lora_rank=16)  # type: ignore[arg-type]
    manager.add(LoRARequest("bin", 1, str(as_bin)))
    ours = our_lora_prefill_logits(net, manager, config, PREFILL_PROMPTS, [1] * len(PREFILL_PROMPTS))
    assert_logits_match(ours, hf_prefill_logits(hf_merged_model(model, good), PREFILL_PROMPTS))

    corrupt = tmp_path / "corrupt"
    shutil.copytree(good, corrupt)
    (corrupt / WEIGHTS).write_bytes((corrupt / WEIGHTS).read_bytes()[:100])
    with pytest.raises(LoRAError, match=r"'corrupt': cannot read .*adapter_model.safetensors"):
        manager.add(LoRARequest("corrupt", 2, str(corrupt)))
    assert manager.lora_ids() == [1]
