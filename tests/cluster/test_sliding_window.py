"""Sliding-window models (Mistral, Qwen2 with use_sliding_window): prompts and generations longer than the
window equal Hugging Face's, through the engine (paged KV, chunked prefill over cached context, prefix cache).
"""

from __future__ import annotations

import pytest
import torch

from raytp import LLM, SamplingParams
from tests.helpers.tiny_models import make_tiny_qwen2

WINDOW = 24


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    # max_window_layers=1: layer 0 attends in full, layer 1 slides (transformers' Qwen2 windows from there on).
    return make_tiny_qwen2(
        tmp_path_factory.mktemp("sw"), use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1
    )


@pytest.mark.parametrize("attention_backend", ["torch", "auto"])
def test_longer_than_the_window_matches_hf(model_dir: str, attention_backend: str) -> None:
    from transformers import AutoModelForCausalLM

    prompts = [list(range(10, 10 + 70)), list(range(40, 40 + 3 * WINDOW + 5))]
    # 32-token step budget: the prompts prefill in chunks on top of their own cached context
    llm = LLM(
        model_dir,
        block_size=8,
        max_num_batched_tokens=32,
        enable_prefix_caching=True,
        attention_backend=attention_backend,
    )
    try:
        assert llm.llm_engine.model_config.layer_windows == (None, WINDOW)
        params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
        ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        again = llm.generate([prompts[0]], params)[0].outputs[0].token_ids  # its prompt now from the prefix cache
    finally:
        llm.llm_engine.shutdown()
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for prompt, got in zip(prompts, ours, strict=True):
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False, min_new_tokens=64)
            assert got == ref[0, len(prompt) :].tolist()
    assert again == ours[0]
