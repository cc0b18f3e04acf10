"""Hugging Face transformers as the reference: the same weights, greedy, fp32, one prompt at a time."""

from __future__ import annotations

import functools

import torch

from model_exec.source import resolve_model
from tests.helpers.hf_reference import load_hf_reference_model

# Prompts of different lengths; shared by the parity tests.
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away, there lived a dragon who loved",
    "1, 2, 3, 4,",
    "The three primary colors are red,",
    "In machine learning, a transformer is a neural network architecture that",
    "Q: What is the boiling point of water at sea level?\nA:",
    "Paris, London, Berlin, Madrid,",
    "Photosynthesis converts",
]


@functools.lru_cache(maxsize=4)
def hf_model(model: str | None) -> torch.nn.Module:
    return load_hf_reference_model(resolve_model(model))


def hf_greedy(model: str | None, prompt_ids: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuation of each prompt, ignoring EOS (the engine runs with ignore_eos=True)."""
    key = tuple(tuple(p) for p in prompt_ids)
    return [list(o) for o in _hf_greedy_cached(model, key, max_new_tokens)]


@functools.lru_cache(maxsize=32)
def _hf_greedy_cached(
    model: str | None, prompt_ids: tuple[tuple[int, ...], ...], max_new_tokens: int
) -> tuple[tuple[int, ...], ...]:
    m = hf_model(model)
    outs = []
    with torch.inference_mode():
        for ids in prompt_ids:
            inp = torch.tensor([list(ids)])
            gen = m.generate(
                inp,
                attention_mask=torch.ones_like(inp),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                min_new_tokens=0,
                eos_token_id=None,
                pad_token_id=0,
                temperature=None,
                top_p=None,
                top_k=None,
            )
            outs.append(tuple(gen[0, len(ids) :].tolist()))
    return tuple(outs)
