"""PoolingParams: what a pooling request (an embedding or a score) asks of the engine, as vLLM names it.

A request carries either SamplingParams (generation) or PoolingParams (one forward over the prompt, no
decode step); the engine refuses the kind its runner does not serve. Plain values only: it travels to
the workers inside `NewSeqData`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from request.errors import RequestError

PoolingTask = Literal["embed", "score"]
POOLING_TASKS: tuple[str, ...] = ("embed", "score")


@dataclass(frozen=True)
class PoolingParams:
    # "embed": the pooled (and, as the model's files say, normalized) vector; "score": a cross-encoder's
    # relevance of a (query, document) pair, from its classification head
    task: PoolingTask = "embed"
    # Matryoshka: keep the first `dimensions` features of the embedding, then normalize (vLLM's order)
    dimensions: int | None = None
    # None: as the model's files say (sentence-transformers' Normalize module); True/False override it
    normalize: bool | None = None
    # vLLM's: keep the last `truncate_prompt_tokens` tokens of the input (-1: the last max_model_len); text
    # inputs are cut by the tokenizer from the left, keeping its special tokens (cluster/pooling.py). None:
    # an input over the model's length is refused, naming the length.
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.task not in POOLING_TASKS:
            raise RequestError(f"pooling task must be one of {', '.join(POOLING_TASKS)}, got {self.task!r}.", "task")
        if self.dimensions is not None:
            if isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int) or self.dimensions < 1:
                raise RequestError(f"dimensions must be a positive integer, got {self.dimensions!r}.", "dimensions")
            if self.task != "embed":
                raise RequestError("dimensions applies to embeddings only.", "dimensions")
        keep = self.truncate_prompt_tokens
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep == 0 or keep < -1):
            raise RequestError(
                f"truncate_prompt_tokens must be -1 (the model's length) or a positive integer, got {keep!r}.",
                "truncate_prompt_tokens",
            )
