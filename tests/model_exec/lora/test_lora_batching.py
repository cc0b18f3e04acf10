"""The model runner applies each row's adapter, batched by adapter: steps that mix rows of two adapters and the
base model, decodes and (chunked) prefills, give every row the logits it gets alone in Hugging Face with its
own adapter merged (or the base model)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from model_exec.lora.context import StepLoRA
from model_exec.lora.manager import LoRAManager
from model_exec.model_runner import ModelRunner
from model_exec.parallel import TPGroup
from request.lora import LoRARequest
from request.sampling_params import SamplingParams
from scheduler.outputs import CachedSeqData, NewSeqData, SchedulerOutput
from tests.helpers.family_parity import hf_model
from tests.helpers.lora_models import hf_merged_model, make_peft_adapter
from tests.helpers.tiny_models import load_our_model, make_kv_caches, make_tiny_llama

BLOCK = 4
BLOCKS_PER_SEQ = 8
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def model_and_adapters(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[int, str]]:
    root = tmp_path_factory.mktemp("lora-batch")
    model = make_tiny_llama(root)
    return model, {1: make_peft_adapter(model, root / "a1", seed=1), 2: make_peft_adapter(model, root / "a2", seed=2)}


def _runner(model: str, adapters: dict[int, str]) -> tuple[ModelRunner, Any, dict[int, torch.Tensor]]:
    """A runner with both adapters loaded; its sampler records each sampled row's logits by seed (= seq id)."""
    net, config = load_our_model(model)
    manager = LoRAManager(net, max_loras=2, max_lora_rank=16)  # type: ignore[arg-type]
    for lora_id, path in adapters.items():
        manager.add(LoRARequest(f"a{lora_id}", lora_id, path))
    runner = ModelRunner(net, TPGroup.single(), BLOCK, torch.device("cpu"), (2,), lora=manager)  # type: ignore[arg-type]
    seen: dict[int, torch.Tensor] = {}
    real = runner.sampler

    def spy(logits: torch.Tensor, meta: Any) -> Any:
        for i, seed in enumerate(meta.seeds):
            seen[seed] = logits[i].clone()
        return real(logits, meta)

    runner.sampler = spy  # type: ignore[assignment]
    return runner, config, seen


def _new(seq_id: int, tokens: list[int], lora_id: int, scheduled: int | None = None) -> NewSeqData:
    first = 1 + seq_id * BLOCKS_PER_SEQ
    return NewSeqData(
        seq_id=seq_id,
        token_ids=tokens,
        num_prompt_tokens=len(tokens),
        block_ids=list(range(first, first + BLOCKS_PER_SEQ)),
        num_computed_tokens=0,
        num_scheduled_tokens=len(tokens) if scheduled is None else scheduled,
        sampling_params=GREEDY,
        seed=seq_id,
        sample_index=0,
        lora_id=lora_id,
    )


def _decode(seq_id: int, token: int, computed: int) -> CachedSeqData:
    return CachedSeqData(seq_id, [token], BLOCKS_PER_SEQ, [], computed, 1)


@torch.inference_mode()
def _reference(model: str, adapters: dict[int, str], lora_id: int, tokens: list[int]) -> torch.Tensor:
    hf = hf_merged_model(model, adapters[lora_id]) if lora_id else hf_model(model)
    return hf(torch.tensor([tokens])).logits[0, -1].float()


def test_rows_of_two_adapters_and_the_base_model_in_one_batch(
    model_and_adapters: tuple[str, dict[int, str]],
) -> None:
    model, adapters = model_and_adapters
    runner, config, seen = _runner(model, adapters)
    caches = make_kv_caches(config, 1, 1 + 8 * BLOCKS_PER_SEQ, BLOCK, torch.float32, "cpu")
    prompts = {s: [3 + (5 * s + 7 * i) % 250 for i in range(5 + 3 * s)] for s in range(6)}
    lora_of = {0: 1, 1: 0, 2: 2, 3: 1, 4: 2, 5: 1}

    # step 1: four prefills, adapters 1, base, 2, 1
    so = SchedulerOutput(
        new_seqs=[_new(s, prompts[s], lora_of[s]) for s in range(4)], num_samples=dict.fromkeys(range(4), 1)
    )
    runner.execute(so, caches)
    # step 2: those four decode (token 77), seq 4 (adapter 2) prefills whole, seq 5 (adapter 1) its first 6 tokens
    decodes = [_decode(s, 77, len(prompts[s])) for s in range(4)]
    so = SchedulerOutput(
        new_seqs=[_new(4, prompts[4], lora_of[4]), _new(5, prompts[5], lora_of[5], scheduled=6)],
        cached_seqs=decodes,
        num_samples=dict.fromkeys(range(5), 1),
    )
    runner.execute(so, caches)
    step2 = dict(seen)
    # step 3: seq 5's prefill finishes over its cached first chunk, beside decodes of seqs 0 and 2
    so = SchedulerOutput(
        cached_seqs=[
            _decode(0, 78, len(prompts[0]) + 1),
            _decode(2, 78, len(prompts[2]) + 1),
            CachedSeqData(5, [], BLOCKS_PER_SEQ, [], 6, len(prompts[5]) - 6),
        ],
        num_samples={0: 1, 2: 1, 5: 1},
    )
    runner.execute(so, caches)

    for s in range(5):
        want = _reference(model, adapters, lora_of[s], [*prompts[s], 77] if s < 4 else prompts[s])
        torch.testing.assert_close(step2[s], want, atol=1e-4, rtol=1e-4, msg=f"seq {s}, step 2")
    for s in (0, 2):
        want = _reference(model, adapters, lora_of[s], [*prompts[s], 77, 78])
        torch.testing.assert_close(seen[s], want, atol=1e-4, rtol=1e-4, msg=f"seq {s}, step 3")
    torch.testing.assert_close(seen[5], _reference(model, adapters, 1, prompts[5]), atol=1e-4, rtol=1e-4)
    # the adapters really differ from each other and from the base model on these rows
    assert (_reference(model, adapters, 1, prompts[0]) - _reference(model, adapters, 2, prompts[0])).abs().max() > 0.1


def test_step_groups_are_contiguous_ranges_per_adapter() -> None:
    # rows as the runner orders them: decodes by adapter, then prefills by adapter
    step = StepLoRA.from_rows([0, 1, 1, 2, 0, 1, 2], [0, 1, 2, 3, 4, 9, 12, 20])
    assert step is not None
    assert step.groups == ((1, ((1, 3), (9, 12))), (2, ((3, 4), (12, 20))))
    assert StepLoRA.from_rows([0, 0], [0, 1, 5]) is None


def test_a_step_with_an_adapter_not_loaded_or_too_many_adapters_raises(
    model_and_adapters: tuple[str, dict[int, str]],
) -> None:
    model, adapters = model_and_adapters
    runner, config, _ = _runner(model, adapters)
    caches = make_kv_caches(config, 1, 1 + 4 * BLOCKS_PER_SEQ, BLOCK, torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"ids \[3\].*not loaded"):
        runner.execute(SchedulerOutput(new_seqs=[_new(0, [5, 6, 7], 3)], num_samples={0: 1}), caches)
    assert runner.lora is not None
    runner.lora.max_loras = 1
    with pytest.raises(ValueError, match="over max_loras=1"):
        runner.execute(SchedulerOutput(new_seqs=[_new(1, [5, 6], 1), _new(2, [5, 6], 2)], num_samples={}), caches)
    assert runner.lora.context.step is None  # the context is cleared after a failed step


def test_without_enable_lora_layers_carry_no_lora_and_a_lora_row_is_refused(
    model_and_adapters: tuple[str, dict[int, str]],
) -> None:
    model, _ = model_and_adapters
    net, config = load_our_model(model)
    assert all(getattr(m, "lora", None) is None for m in net.modules())
    runner = ModelRunner(net, TPGroup.single(), BLOCK, torch.device("cpu"), (2,))  # type: ignore[arg-type]
    caches = make_kv_caches(config, 1, 1 + BLOCKS_PER_SEQ, BLOCK, torch.float32, "cpu")
    with pytest.raises(ValueError, match="without enable_lora"):
        runner.execute(SchedulerOutput(new_seqs=[_new(0, [5, 6, 7], 1)], num_samples={0: 1}), caches)


def test_decode_rows_of_one_adapter_are_one_slice(model_and_adapters: tuple[str, dict[int, str]]) -> None:
    """The runner's row order puts each adapter's decode rows together: a pure-decode step of interleaved
    adapters runs one range per adapter."""
    model, adapters = model_and_adapters
    runner, config, _ = _runner(model, adapters)
    caches = make_kv_caches(config, 1, 1 + 6 * BLOCKS_PER_SEQ, BLOCK, torch.float32, "cpu")
    lora_of = [1, 2, 0, 1, 2, 1]
    runner.execute(SchedulerOutput(new_seqs=[_new(s, [5, 6, 7], lora_of[s]) for s in range(6)], num_samples={}), caches)
    assert runner.lora is not None
    steps: list[StepLoRA | None] = []
    real_step = runner.lora.step

    def record(ids: list[int], starts: list[int]) -> StepLoRA | None:
        steps.append(real_step(ids, starts))
        return steps[-1]

    runner.lora.step = record  # type: ignore[method-assign]
    runner.execute(SchedulerOutput(cached_seqs=[_decode(s, 9, 3) for s in range(6)], num_samples={}), caches)
    (step,) = steps
    assert step is not None
    assert step.groups == ((1, ((1, 4),)), (2, ((4, 6),)))


def test_adapters_change_only_between_forwards(model_and_adapters: tuple[str, dict[int, str]]) -> None:
    """remove/add from another thread (the in-process executor's event loop) waits for the running forward;
    a forward inside a forward is refused."""
    model, adapters = model_and_adapters
    runner, _, _ = _runner(model, adapters)
    manager = runner.lora
    assert manager is not None
    removed: list[bool] = []
    remover = threading.Thread(target=lambda: removed.append(manager.remove(1)))
    with manager.batch([1, 2], [0, 3, 5]) as step:
        assert step is not None and step.lora_ids == [1, 2]
        remover.start()
        remover.join(timeout=0.3)
        assert remover.is_alive() and manager.lora_ids() == [1, 2]  # still waiting for the forward to end
        with pytest.raises(RuntimeError, match="do not nest"), manager.batch([1], [0, 1]):
            pass
    remover.join(timeout=10)
    assert removed == [True] and manager.lora_ids() == [2]
