"""The worker protocol with LoRA: `Worker.add_lora` / `remove_lora` / `list_loras`, then `execute_model` with rows of
two adapters and the base model, in-process at TP 1 and over real gloo processes at TP 2 (each rank loads its own
shard of the adapters; the row-parallel LoRA terms ride the layers' own all-reduce). Rank 0's sampled greedy
token of every row, and its logprob, equal HF's with that row's adapter merged."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest
import torch

from cluster.config import EngineConfig
from cluster.engine import resolve_config
from cluster.worker import Worker
from model_exec.source import read_model_config, resolve_model
from request.lora import LoRAError, LoRARequest
from request.sampling_params import SamplingParams
from scheduler.outputs import ModelRunnerOutput, NewSeqData, SchedulerOutput
from tests.helpers.family_parity import hf_model
from tests.helpers.lora_models import hf_merged_model, make_peft_adapter
from tests.helpers.tiny_models import make_tiny_llama

PROMPTS = {0: [5, 17, 33, 2, 101, 250, 7], 1: [42, 9, 9, 13], 2: [3 + (7 * i) % 250 for i in range(13)], 3: [60, 61]}
LORA_OF = {0: 1, 1: 0, 2: 2, 3: 1}
BLOCKS_PER_SEQ = 4


@pytest.fixture(scope="module")
def model_and_adapters(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[int, str]]:
    root = tmp_path_factory.mktemp("lora-worker")
    model = make_tiny_llama(root)
    return model, {1: make_peft_adapter(model, root / "a1", seed=1), 2: make_peft_adapter(model, root / "a2", seed=2)}


def _step() -> SchedulerOutput:
    params = SamplingParams(temperature=0.0, logprobs=1)
    new = [
        NewSeqData(
            seq_id=s,
            token_ids=p,
            num_prompt_tokens=len(p),
            block_ids=list(range(1 + s * BLOCKS_PER_SEQ, 1 + (s + 1) * BLOCKS_PER_SEQ)),
            num_computed_tokens=0,
            num_scheduled_tokens=len(p),
            sampling_params=params,
            seed=s,
            sample_index=0,
            lora_id=LORA_OF[s],
        )
        for s, p in PROMPTS.items()
    ]
    return SchedulerOutput(new_seqs=new, num_samples=dict.fromkeys(PROMPTS, 1))


def _worker(model: str, rank: int = 0, world_size: int = 1, enable_lora: bool = True) -> Worker:
    config = EngineConfig(
        model=model, device="cpu", attention_backend="torch", block_size=8, enable_lora=enable_lora, max_loras=2,
        num_gpu_blocks_override=1 + len(PROMPTS) * BLOCKS_PER_SEQ, swap_space=0, tensor_parallel_size=world_size,
    )  # fmt: skip
    model_config = read_model_config(resolve_model(model))
    return Worker(resolve_config(config, model_config), model_config, rank, world_size)


def _serve(worker: Worker, adapters: dict[int, str], init: str | None = None) -> ModelRunnerOutput | None:
    worker.load_model(init)
    worker.init_cache(*worker.determine_num_blocks())
    for lora_id, path in adapters.items():
        worker.add_lora(LoRARequest(f"a{lora_id}", lora_id, path))
    assert worker.list_loras() == sorted(adapters)
    return worker.execute_model(_step())


@torch.inference_mode()
def _assert_matches_hf(out: ModelRunnerOutput | None, model: str, adapters: dict[int, str]) -> None:
    assert out is not None
    for s, prompt in PROMPTS.items():
        hf = hf_merged_model(model, adapters[LORA_OF[s]]) if LORA_OF[s] else hf_model(model)
        logprobs = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, -1].float(), -1)
        sample = out.samples[s]
        assert sample.token_ids == [int(logprobs.argmax())], f"seq {s}"
        assert sample.cumulative_logprob_deltas[0] == pytest.approx(float(logprobs.max()), abs=1e-4)


def test_worker_serves_adapters_in_process(model_and_adapters: tuple[str, dict[int, str]]) -> None:
    model, adapters = model_and_adapters
    worker = _worker(model)
    try:
        _assert_matches_hf(_serve(worker, adapters), model, adapters)
        assert worker.remove_lora(2) is True and worker.remove_lora(2) is False
        assert worker.list_loras() == [1]
    finally:
        worker.shutdown()


def test_worker_without_enable_lora_refuses_adapters(model_and_adapters: tuple[str, dict[int, str]]) -> None:
    model, adapters = model_and_adapters
    worker = _worker(model, enable_lora=False)
    try:
        worker.load_model()
        with pytest.raises(LoRAError, match="'a1'.*without enable_lora"):
            worker.add_lora(LoRARequest("a1", 1, adapters[1]))
        assert worker.list_loras() == [] and worker.remove_lora(1) is False
    finally:
        worker.shutdown()


def _gloo_rank(rank: int, init: str, model: str, adapters: dict[int, str], out_file: str) -> None:
    torch.set_num_threads(1)
    worker = _worker(model, rank, world_size=2)
    try:
        out = _serve(worker, adapters, init)
        if rank == 0:
            torch.save(out, out_file)
        else:
            assert out is None
    finally:
        worker.shutdown()


def test_worker_serves_adapters_over_gloo_tp2(model_and_adapters: tuple[str, dict[int, str]], tmp_path: Path) -> None:
    model, adapters = model_and_adapters
    out = tmp_path / "out.pt"
    ctx = mp.get_context("spawn")
    args = (f"file://{tmp_path / 'rendezvous'}", model, adapters, str(out))
    procs = [ctx.Process(target=_gloo_rank, args=(r, *args)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
    for p in procs:
        if p.is_alive():
            p.kill()
    assert [p.exitcode for p in procs] == [0, 0]
    _assert_matches_hf(torch.load(out, weights_only=False), model, adapters)
