"""POST /v1/embeddings: inputs -> one pooling request each -> OpenAI's embedding list.

Each input (a string, token ids, or a list of either) is one engine request with `PoolingParams`; the
engine refuses a model that does not embed (a generation model, a cross-encoder) with a 400 naming why,
and a too-long input with a 400 naming `input`, unless `truncate_prompt_tokens` asks to keep its end.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np

from cluster.pooling import truncate_ids, truncation_length
from raytp.openai.completions import tokenized_prompts
from raytp.openai.models import ModelsHandler
from raytp.openai.pooling_protocol import EmbeddingData, EmbeddingRequest, EmbeddingResponse, PoolingUsage
from raytp.openai.pooling_runs import run_pooling
from request.pooling_params import PoolingParams


def encode_embedding(vector: Any, encoding_format: str) -> list[float] | str:
    """OpenAI's two encodings: a JSON float list, or base64 of the little-endian float32 bytes."""
    values = np.asarray(vector, dtype="<f4")
    if encoding_format == "base64":
        return base64.b64encode(values.tobytes()).decode("ascii")
    return values.tolist()


class EmbeddingHandler(ModelsHandler):
    async def create(self, req: EmbeddingRequest, request_id: str) -> EmbeddingResponse:
        ctx = self.models.resolve(req.model)
        params = PoolingParams(
            task="embed", dimensions=req.dimensions, normalize=req.normalize,
            truncate_prompt_tokens=req.truncate_prompt_tokens,
        )  # fmt: skip
        keep = truncation_length(params.truncate_prompt_tokens, ctx.max_model_len)
        prompts = await tokenized_prompts(ctx, req.input, req.add_special_tokens, "input", keep)
        inputs = [truncate_ids(ids, keep) for _, ids in prompts]  # token-id inputs keep their last ids
        pooled = await run_pooling(ctx, request_id, inputs, params)
        fmt = req.encoding_format
        data = [EmbeddingData(index=i, embedding=encode_embedding(v, fmt)) for i, v in enumerate(pooled)]
        num_tokens = sum(len(ids) for ids in inputs)
        usage = PoolingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens)
        return EmbeddingResponse(id=request_id, model=ctx.model_name, data=data, usage=usage)
