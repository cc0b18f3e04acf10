"""Sliding-window models (Mistral, Qwen2 with use_sliding_window): never silently wrong.

raytp's attention is always full. Up to `sliding_window` tokens full attention and windowed attention
are the same computation, so the engine caps the context at the window: outputs stay equal to HF's,
and a context that would need the window is refused with a clear error instead of diverging.
"""

from __future__ import annotations

import pytest
import torch

from raytp import LLM, RequestError, SamplingParams
from tests.helpers.tiny_models import make_tiny_qwen2

WINDOW = 32


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    # max_window_layers=0: every layer slides (transformers' Qwen2 applies the window from that layer on).
    return make_tiny_qwen2(
        tmp_path_factory.mktemp("sw"), use_sliding_window=True, sliding_window=WINDOW, max_window_layers=0
    )


def test_context_is_capped_at_the_window_and_outputs_match_hf(model_dir: str) -> None:
    from transformers import AutoModelForCausalLM

    llm = LLM(model_dir, block_size=8)
    try:
        assert llm.llm_engine.max_model_len == WINDOW
        prompt = list(range(10, 30))  # 20 prompt + 12 generated = exactly the window
        out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
        ours = out[0].outputs[0].token_ids

        hf = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, min_new_tokens=12)
        assert ours == ref[0, len(prompt) :].tolist()

        with pytest.raises(RequestError) as err:  # would need the window: refused, not wrong
            llm.generate([list(range(10, 10 + WINDOW + 1))], SamplingParams(max_tokens=1))
        assert err.value.param == "prompt"
    finally:
        llm.llm_engine.shutdown()


def test_asking_for_more_than_the_window_names_it(model_dir: str) -> None:
    with pytest.raises(ValueError, match="sliding_window"):
        LLM(model_dir, max_model_len=2 * WINDOW)
