"""`build_processor`: raytp on a Ray Dataset, shaped like Ray Data LLM's `build_llm_processor`.

    config = ProcessorConfig(model_source="/models/llama", engine_kwargs={"max_model_len": 4096},
                             concurrency=2, batch_size=64)
    processor = build_processor(
        config,
        preprocess=lambda row: dict(messages=[{"role": "user", "content": row["q"]}],
                                    sampling_params=dict(max_tokens=64, temperature=0)),
        postprocess=lambda row: dict(answer=row["generated_text"], **row),
    )
    ds = processor(ds)  # lazy: nothing runs until the dataset is consumed

Pipeline: `map(preprocess + request_of)` -> `map_batches(RowReplica, concurrency=N)` -> `map(postprocess)`.
A row carries `prompt` (-> /v1/completions) or `messages` (-> /v1/chat/completions) and optionally
`sampling_params`, a dict of that endpoint's OpenAI request fields (max_tokens, temperature, seed,
stop, n, logprobs, ...). The request is answered by the batch job's own replica, i.e. by the HTTP
server's handlers (row_replica.py), so validation and answers are the server's. Output columns:
`generated_text`, `num_input_tokens`, `num_generated_tokens`, `finish_reason`, `error` (null on
success), `status_code`, `request_id` and `response` (the OpenAI body as JSON); every input column is
carried through. A bad row gets its `error` and the dataset goes on (unlike Ray Data LLM's default).

Decision: the request is serialized to JSON right after `preprocess`, while it is still the user's
dict: Arrow would otherwise unify `sampling_params` across rows and give each row the others' keys
as nulls. For the same reason a null sampling field means "not set" and is dropped.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from cluster.config import EngineConfig

if TYPE_CHECKING:
    from ray.data import Dataset

Row = dict[str, Any]
RowFn = Callable[[Row], Row]


@dataclass(frozen=True)
class ProcessorConfig:
    """Ray Data LLM's `vLLMEngineProcessorConfig` fields that mean something to raytp."""

    model_source: str | None = None  # HF dir, .gguf file or hub id; None: the embedded SmolLM2
    engine_kwargs: dict[str, Any] = field(default_factory=dict)  # EngineConfig fields (raytp serve's flags)
    tensor_parallel_size: int = 1  # TP ranks per engine replica (may also be given in engine_kwargs)
    concurrency: int = 1  # engine replicas (Ray Data actors, each owning one engine)
    batch_size: int = 64  # rows per map_batches call
    max_concurrency: int | None = None  # rows of one replica in its engine at once; None: batch_size

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "concurrency", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1.")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("max_concurrency must be at least 1.")
        _ = self.engine_config  # unknown or conflicting engine kwargs fail here, not on the cluster

    @property
    def engine_config(self) -> EngineConfig:
        known = {f.name for f in dataclasses.fields(EngineConfig)}
        unknown = sorted(set(self.engine_kwargs) - known)
        if unknown:
            raise ValueError(f"engine_kwargs has unknown engine options: {', '.join(unknown)}")
        if "model" in self.engine_kwargs:
            raise ValueError("give the model as model_source, not in engine_kwargs.")
        tp = self.engine_kwargs.get("tensor_parallel_size", self.tensor_parallel_size)
        if self.tensor_parallel_size != 1 and tp != self.tensor_parallel_size:
            raise ValueError("tensor_parallel_size differs from engine_kwargs['tensor_parallel_size'].")
        kwargs = {**self.engine_kwargs, "tensor_parallel_size": tp}
        return EngineConfig(model=self.model_source, **kwargs)


def _plain(value: Any) -> Any:
    """A row value as JSON-able Python (rows read back from Arrow hold numpy arrays and scalars)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "tolist"):  # numpy arrays and numpy scalars
        return _plain(value.tolist())
    return value


def request_of(row: Row) -> str:
    """The row's request as JSON: `{"url", "body"}`, or `{"error"}` when the row names no request."""
    has_prompt, has_messages = row.get("prompt") is not None, row.get("messages") is not None
    if has_prompt == has_messages:
        return json.dumps({"error": "A row needs exactly one of `prompt` (completions) or `messages` (chat)."})
    params = _plain(row.get("sampling_params") or {})
    if not isinstance(params, dict):
        return json.dumps({"error": "`sampling_params` must be a dict of OpenAI request fields."})
    body = {k: v for k, v in params.items() if v is not None}
    if has_prompt:
        url, body["prompt"] = "/v1/completions", _plain(row["prompt"])
    else:
        url, body["messages"] = "/v1/chat/completions", _plain(row["messages"])
    return json.dumps({"url": url, "body": body}, ensure_ascii=False)


def _prepare(row: Row, preprocess: RowFn | None) -> Row:
    from raytp.batch.row_replica import REQUEST_COLUMN

    out = dict(preprocess(row) if preprocess is not None else row)
    out[REQUEST_COLUMN] = request_of(out)
    return out


class Processor:
    """`ds = processor(ds)`: the rows with the model's answers added (lazy, as Ray Data is)."""

    def __init__(self, config: ProcessorConfig, preprocess: RowFn | None, postprocess: RowFn | None) -> None:
        self.config = config
        self.preprocess = preprocess
        self.postprocess = postprocess

    def __call__(self, ds: Dataset) -> Dataset:
        from raytp.batch.row_replica import RowReplica

        cfg = self.config
        ds = ds.map(functools.partial(_prepare, preprocess=self.preprocess))
        ds = ds.map_batches(
            RowReplica,
            fn_constructor_kwargs={
                "engine_config": cfg.engine_config,
                "max_concurrency": cfg.max_concurrency or cfg.batch_size,
            },
            concurrency=cfg.concurrency,
            batch_size=cfg.batch_size,
            num_cpus=0,  # the replica only relays; its controller and workers hold the resources
            batch_format="pyarrow",
        )
        if self.postprocess is not None:
            ds = ds.map(self.postprocess)
        return ds


def build_processor(
    config: ProcessorConfig, preprocess: RowFn | None = None, postprocess: RowFn | None = None
) -> Processor:
    """Ray Data LLM's `build_llm_processor(config, preprocess=..., postprocess=...)` for raytp engines."""
    return Processor(config, preprocess, postprocess)
