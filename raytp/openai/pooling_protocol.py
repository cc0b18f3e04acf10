"""Request and response models of the pooling routes: OpenAI's `/v1/embeddings`, vLLM's `/v1/score` and
`/v1/rerank` (the Jina / Cohere rerank shape)."""

from __future__ import annotations

import time
from typing import Annotated, Generic, Literal, TypeVar

from pydantic import Field

from raytp.openai.base import OpenAIModel, OpenAIRequest

MAX_INPUTS = 2048  # inputs (or documents) in one request, OpenAI's limit for /v1/embeddings; each is one engine request
TokenId = Annotated[int, Field(ge=0)]
# a string, strings, token ids, or lists of token ids (OpenAI's `input`)
EmbeddingInput = (
    str
    | Annotated[list[str], Field(max_length=MAX_INPUTS)]
    | list[TokenId]
    | Annotated[list[list[TokenId]], Field(max_length=MAX_INPUTS)]
)
Texts = str | Annotated[list[str], Field(max_length=MAX_INPUTS)]
# vLLM's: keep each input's last that many tokens (-1: the model's length); None: a longer input is a 400
TruncatePromptTokens = Annotated[int, Field(ge=-1)] | None


class EmbeddingRequest(OpenAIRequest):
    model: str | None = None
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"  # base64: little-endian float32 bytes, as OpenAI
    dimensions: int | None = Field(default=None, ge=1)  # Matryoshka: the first `dimensions` features
    user: str | None = None  # OpenAI's end-user id: metadata, no effect on the output
    # vLLM's extensions
    normalize: bool | None = None  # None: as the model's files say (sentence-transformers' Normalize)
    add_special_tokens: bool = True
    truncate_prompt_tokens: TruncatePromptTokens = None


class PoolingUsage(OpenAIModel):
    prompt_tokens: int = 0
    total_tokens: int = 0


class EmbeddingData(OpenAIModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


DataT = TypeVar("DataT", bound=OpenAIModel)


class ListResponse(OpenAIModel, Generic[DataT]):
    """OpenAI's list object, the shape of /v1/embeddings' answer that vLLM's /v1/score answer takes too."""

    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[DataT]
    usage: PoolingUsage


class EmbeddingResponse(ListResponse[EmbeddingData]):
    """/v1/embeddings' answer: one vector per input, in input order."""


class ScoreRequest(OpenAIRequest):
    model: str | None = None
    text_1: Texts  # one query against every text_2, or as many as text_2 (zipped)
    text_2: Texts
    user: str | None = None
    truncate_prompt_tokens: TruncatePromptTokens = None  # per pair (a cross-encoder) or per text (cosine)


class ScoreData(OpenAIModel):
    object: Literal["score"] = "score"
    index: int
    score: float


class ScoreResponse(ListResponse[ScoreData]):
    """/v1/score's answer: one score per pair, in pair order."""


class RerankRequest(OpenAIRequest):
    model: str | None = None
    query: str
    documents: Annotated[list[str], Field(max_length=MAX_INPUTS)]
    top_n: int | None = Field(default=None, ge=0)  # None or 0: every document
    return_documents: bool = True
    user: str | None = None
    truncate_prompt_tokens: TruncatePromptTokens = None  # per (query, document) pair, or per text


class RerankDocument(OpenAIModel):
    text: str


class RerankResult(OpenAIModel):
    index: int
    document: RerankDocument | None = None
    relevance_score: float


class RerankResponse(OpenAIModel):
    id: str
    model: str
    usage: PoolingUsage
    results: list[RerankResult]
