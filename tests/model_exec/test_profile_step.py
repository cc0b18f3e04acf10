"""The profile step that sizes the CUDA KV pool (model_runner.profile_forward), run on the CPU: the
largest prefill, then logits and a sampler pass over max_num_seqs rows at the sampler's heaviest settings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from model_exec.model_runner import ModelRunner, profile_forward
from model_exec.parallel import TPGroup
from tests.helpers.tiny_models import load_our_model, make_kv_caches, make_tiny_llama


def test_profile_step_runs_the_sampler_over_max_num_seqs_rows(tmp_path: Path) -> None:
    net, config = load_our_model(make_tiny_llama(tmp_path / "tiny"))
    runner = ModelRunner(net, TPGroup.single(), 16, torch.device("cpu"), (2,))
    calls: list[tuple[Any, ...]] = []
    real_sampler = runner.sampler

    def spy(logits: torch.Tensor, meta: Any) -> Any:
        calls.append((tuple(logits.shape), meta.num_rows, meta.params[0]))
        return real_sampler(logits, meta)

    runner.sampler = spy  # type: ignore[assignment]
    blocks: list[int] = []

    def make_cache(num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        blocks.append(num_blocks)
        return make_kv_caches(config, 1, num_blocks, 16, torch.float32, "cpu")

    profile_forward(runner, 100, 48, make_cache)
    assert blocks == [7]  # ceil(100 / 16)
    ((shape, rows, params),) = calls
    assert shape == (48, config.vocab_size) and rows == 48
    assert params.top_p < 1 and params.top_k > 0 and params.repetition_penalty != 1 and params.logprobs
    # More logit rows than tokens: the sampler still sees max_num_seqs rows.
    profile_forward(runner, 10, 32, make_cache)
    assert calls[-1][:2] == ((32, config.vocab_size), 32)
