"""POST /v1/score and POST /v1/rerank (vLLM's routes; rerank in the Jina / Cohere shape).

A cross-encoder scores each (query, document) pair in one forward; an embedding model scores the
cosine of their embeddings. A generation model is refused by the engine (a 400 naming why).
"""

from __future__ import annotations

from cluster.pooling_outputs import score_pairs as pair_up
from raytp.openai.models import ModelsHandler
from raytp.openai.pooling_protocol import (
    PoolingUsage,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
)
from raytp.openai.pooling_runs import score_pairs


class ScoreHandler(ModelsHandler):
    async def create(self, req: ScoreRequest, request_id: str) -> ScoreResponse:
        ctx = self.models.resolve(req.model)
        pairs = pair_up(req.text_1, req.text_2)
        scores, num_tokens = await score_pairs(ctx, request_id, pairs, req.truncate_prompt_tokens)
        data = [ScoreData(index=i, score=s) for i, s in enumerate(scores)]
        usage = PoolingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens)
        return ScoreResponse(id=request_id, model=ctx.model_name, data=data, usage=usage)


class RerankHandler(ModelsHandler):
    async def create(self, req: RerankRequest, request_id: str) -> RerankResponse:
        ctx = self.models.resolve(req.model)
        pairs = pair_up(req.query, req.documents)
        scores, num_tokens = await score_pairs(ctx, request_id, pairs, req.truncate_prompt_tokens)
        order = sorted(range(len(scores)), key=lambda i: -scores[i])
        if req.top_n:
            order = order[: req.top_n]
        results = [
            RerankResult(
                index=i,
                document=RerankDocument(text=req.documents[i]) if req.return_documents else None,
                relevance_score=scores[i],
            )
            for i in order
        ]
        usage = PoolingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens)
        return RerankResponse(id=request_id, model=ctx.model_name, usage=usage, results=results)
