"""Pooling requests over the engine client, shared by the embedding, score and rerank handlers."""

from __future__ import annotations

import asyncio
from typing import Any

from cluster.pooling import truncation_length
from cluster.pooling_outputs import cosine, score_of
from raytp.openai.context import ServingContext
from raytp.openai.errors import bad_request
from raytp.openai.stream import RequestStream, start_all
from request.pooling_params import PoolingParams, PoolingTask


async def _pooled(stream: RequestStream) -> Any:
    result = None
    async for delta in stream.deltas():  # raises when the engine could not finish the request
        if delta.finished:
            result = delta.pooled
    return result


async def run_pooling(
    ctx: ServingContext, request_id: str, inputs: list[list[int]], params: PoolingParams
) -> list[Any]:
    """One pooling request per input, run together; their results in input order. A refusal of any (a
    generation model, a too-long input) ends the others and raises it (a 400)."""
    if not inputs:
        raise bad_request("input must not be empty.", "input")
    streams = [ctx.stream(f"{request_id}-{i}", ids, params) for i, ids in enumerate(inputs)]
    await start_all(streams)
    try:
        return list(await asyncio.gather(*(_pooled(s) for s in streams)))
    finally:
        await asyncio.gather(*(s.close() for s in streams), return_exceptions=True)


async def score_pairs(
    ctx: ServingContext, request_id: str, pairs: list[tuple[str, str]], truncate_prompt_tokens: int | None = None
) -> tuple[list[float], int]:
    """(score per pair, prompt tokens): a cross-encoder scores each pair in one forward; an embedding
    model scores the cosine of the two texts' embeddings (vLLM's two ways). `truncate_prompt_tokens` cuts
    each pair (a cross-encoder) or each text (an embedding model) to its last that many tokens."""
    task: PoolingTask = "score" if ctx.pooling_task == "score" else "embed"
    params = PoolingParams(task=task, truncate_prompt_tokens=truncate_prompt_tokens)
    keep = truncation_length(params.truncate_prompt_tokens, ctx.max_model_len)
    if task == "score":
        inputs = [await ctx.tokenize_pair(a, b, keep) for a, b in pairs]
        pooled = await run_pooling(ctx, request_id, inputs, params)
        return [score_of(p) for p in pooled], sum(len(i) for i in inputs)
    texts = list(dict.fromkeys([a for a, _ in pairs] + [b for _, b in pairs]))
    inputs = [await ctx.encode(t, param="text_1", keep=keep) for t in texts]
    vectors = dict(zip(texts, await run_pooling(ctx, request_id, inputs, params), strict=True))
    return [cosine(vectors[a], vectors[b]) for a, b in pairs], sum(len(i) for i in inputs)

