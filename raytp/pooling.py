"""The offline pooling calls behind `LLM.embed` and `LLM.score`: requests into the engine, the engine's one
output stream folded into vLLM's output types."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

from tqdm.auto import tqdm

from cluster.engine import LLMEngine, PromptType
from cluster.pooling import pair_token_ids, truncation_length
from cluster.pooling_outputs import (
    EmbeddingOutput,
    EmbeddingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
    cosine,
    score_of,
    score_pairs,
)
from request.pooling_params import PoolingParams


def run_pooling(
    engine: LLMEngine, prompts: list[PromptType], params: PoolingParams, ids: Iterator[int], use_tqdm: bool
) -> list[tuple[str, Any, list[int]]]:
    """(request id, pooled result, prompt token ids) per prompt, in input order.

    Decision: the prompts enter the engine longest first (sentence-transformers' `encode` order), so each
    step's batch holds texts of like length and pads little; ids and results keep the input order."""
    rids = [str(next(ids)) for _ in prompts]
    added: list[str] = []
    try:
        for i in sorted(range(len(prompts)), key=lambda i: -_size(prompts[i])):
            engine.add_request(rids[i], prompts[i], params)
            added.append(rids[i])
    except Exception:
        engine.abort_request(added)  # a bad prompt refuses the whole call, and frees what it queued
        raise
    results: dict[str, tuple[Any, list[int]]] = {}
    token_ids: dict[str, list[int]] = {}
    wanted = set(rids)
    bar = tqdm(total=len(rids), desc="Processed prompts", disable=not use_tqdm)
    while engine.has_unfinished_requests():
        for delta in engine.step():
            if delta.request_id not in wanted:
                continue
            if delta.prompt is not None:
                token_ids[delta.request_id] = delta.prompt.token_ids
            if delta.finished:
                if delta.error is not None:
                    raise RuntimeError(f"request {delta.request_id} failed: {delta.error}")
                results[delta.request_id] = (delta.pooled, token_ids.get(delta.request_id, []))
                bar.update(1)
    bar.close()
    return [(rid, *results[rid]) for rid in rids]


def _size(prompt: PromptType) -> int:
    """A prompt's length for ordering: characters of a text, or token ids (as sentence-transformers orders)."""
    if isinstance(prompt, str):
        return len(prompt)
    if isinstance(prompt, dict):
        ids = prompt.get("prompt_token_ids")
        return len(ids) if ids is not None else len(str(prompt.get("prompt", "")))
    return len(prompt)


def with_truncation(params: PoolingParams, truncate_prompt_tokens: int | None) -> PoolingParams:
    """`params` with the call's truncate_prompt_tokens (vLLM's keyword), which wins over the params' own."""
    if truncate_prompt_tokens is None:
        return params
    return replace(params, truncate_prompt_tokens=truncate_prompt_tokens)


def embed(
    engine: LLMEngine, prompts: list[PromptType], params: PoolingParams, ids: Iterator[int], use_tqdm: bool
) -> list[EmbeddingRequestOutput]:
    return [
        EmbeddingRequestOutput(rid, EmbeddingOutput([float(v) for v in pooled]), token_ids)
        for rid, pooled, token_ids in run_pooling(engine, prompts, params, ids, use_tqdm)
    ]


def score(
    engine: LLMEngine,
    text_1: str | Sequence[str],
    text_2: str | Sequence[str],
    ids: Iterator[int],
    use_tqdm: bool,
    truncate_prompt_tokens: int | None = None,
) -> list[ScoringRequestOutput]:
    """A cross-encoder scores each pair in one forward; an embedding model scores the cosine of the two
    embeddings (vLLM's two ways)."""
    pairs = score_pairs(text_1, text_2)
    if engine.pooling_task == "score":
        params = PoolingParams(task="score", truncate_prompt_tokens=truncate_prompt_tokens)
        keep = truncation_length(truncate_prompt_tokens, engine.limits.max_model_len)
        prompts: list[PromptType] = [
            {"prompt_token_ids": pair_token_ids(engine.tokenizer, a, b, keep)} for a, b in pairs
        ]
        done = run_pooling(engine, prompts, params, ids, use_tqdm)
        return [ScoringRequestOutput(rid, ScoringOutput(score_of(p)), t) for rid, p, t in done]
    firsts = list(dict.fromkeys(a for a, _ in pairs))
    seconds = [b for _, b in pairs]
    params = PoolingParams(task="embed", truncate_prompt_tokens=truncate_prompt_tokens)
    vectors = embed(engine, [*firsts, *seconds], params, ids, use_tqdm)
    by_first = dict(zip(firsts, vectors[: len(firsts)], strict=True))
    return [
        ScoringRequestOutput(
            out.request_id,
            ScoringOutput(cosine(by_first[a].outputs.embedding, out.outputs.embedding)),
            by_first[a].prompt_token_ids + out.prompt_token_ids,
        )
        for (a, _), out in zip(pairs, vectors[len(firsts) :], strict=True)
    ]
