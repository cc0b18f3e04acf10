"""What pooling requests return offline, as vLLM names it: `LLM.embed` gives `EmbeddingRequestOutput`s
(`.outputs.embedding`), `LLM.score` gives `ScoringRequestOutput`s (`.outputs.score`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from request.errors import RequestError


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ScoringOutput:
    score: float


@dataclass
class EmbeddingRequestOutput:
    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class ScoringRequestOutput:
    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True


def score_of(pooled: Any) -> float:
    """A cross-encoder's score: its one label's (activated) logit; vLLM's score is that single value."""
    values = [float(v) for v in pooled]
    if len(values) != 1:
        raise ValueError(f"a score needs a cross-encoder with one label; this one has {len(values)}")
    return values[0]


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    """vLLM's score for embedding models: the cosine similarity of the two embeddings."""
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return dot / norm if norm else 0.0


def score_pairs(text_1: str | Sequence[str], text_2: str | Sequence[str]) -> list[tuple[str, str]]:
    """vLLM's pairing: one text_1 against every text_2 (or one text_2), or two lists of one length, zipped."""
    firsts = [text_1] if isinstance(text_1, str) else list(text_1)
    seconds = [text_2] if isinstance(text_2, str) else list(text_2)
    if not firsts or not seconds:
        raise RequestError("score needs at least one text on each side.", "text_1" if not firsts else "text_2")
    if len(firsts) == 1:
        return [(firsts[0], t) for t in seconds]
    if len(firsts) != len(seconds):
        raise RequestError(
            f"text_1 has {len(firsts)} texts and text_2 {len(seconds)}: give one text_1, or as many.", "text_2"
        )
    return list(zip(firsts, seconds, strict=True))
