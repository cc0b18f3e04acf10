"""ServedModels: what one front door serves, by the name clients send as `model`: each base model's
`ServingContext`, and the LoRA adapters on top of them.

Every handler picks its request's context here (`resolve`), over HTTP and in batch jobs alike, so a
request for an adapter runs with that adapter's `LoRARequest` whichever road it came by, and an unknown
name is the same 404 everywhere. The names share one namespace: an adapter may not take a base model's
name or another adapter's (`check_free`).

The adapter table changes at runtime (POST /v1/load_lora_adapter, and every ingress replica's copy kept in
step by raytp/serve/lora_sync.py): `set_adapters` replaces it whole. The event loop is the only writer.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from raytp.openai.context import ServingContext
from raytp.openai.errors import OpenAIError, bad_request
from raytp.openai.protocol import ModelCard
from request.lora import LoRARequest


@dataclass(frozen=True)
class Adapter:
    lora: LoRARequest
    base_model: str  # the served name of the model it adapts


def model_not_found(name: str, served: Sequence[str]) -> OpenAIError:
    listed = ", ".join(f"`{n}`" for n in served)
    return OpenAIError(
        f"The model `{name}` does not exist. This server serves: {listed}.",
        404,
        "invalid_request_error",
        param="model",
        code="model_not_found",
    )


class ServedModels:
    def __init__(self, contexts: Sequence[ServingContext], adapters: Iterable[Adapter] = ()) -> None:
        if not contexts:
            raise ValueError("ServedModels needs at least one model.")
        self._models: dict[str, ServingContext] = {c.model_name: c for c in contexts}
        if len(self._models) != len(contexts):
            raise ValueError("served model names must be unique.")
        self._adapters: dict[str, Adapter] = {}
        self._adapter_contexts: dict[str, ServingContext] = {}
        self.set_adapters(adapters)

    @classmethod
    def of(cls, served: ServedModels | ServingContext) -> ServedModels:
        """A handler's models: a single context (one model, no adapters) stands for itself."""
        return served if isinstance(served, ServedModels) else cls([served])

    @property
    def base_names(self) -> list[str]:
        return list(self._models)

    def names(self) -> list[str]:
        """Every name a request may send as `model`: the base models, then the adapters."""
        return [*self._models, *self._adapters]

    def context(self, base_model: str) -> ServingContext:
        """A base model's own context (KeyError when it is not served)."""
        return self._models[base_model]

    def adapters(self) -> list[Adapter]:
        return list(self._adapters.values())

    def resolve(self, name: str | None) -> ServingContext:
        """The context a request naming `model` runs in. Omitted: the only base model; with several, the
        request must name one (a 400 listing them), since a default would answer from a model the client
        may not expect."""
        if not name:
            if len(self._models) == 1:
                return next(iter(self._models.values()))
            raise bad_request(f"model is required: this server serves {', '.join(self.names())}.", "model")
        ctx = self._models.get(name) or self._adapter_contexts.get(name)
        if ctx is None:
            raise model_not_found(name, self.names())
        return ctx

    def check_free(self, name: str) -> None:
        """A 400 unless `name` is free for a new adapter."""
        if name in self._models:
            raise bad_request(f"The name `{name}` is a served base model; choose another lora_name.", "lora_name")
        if name in self._adapters:
            raise bad_request(f"The LoRA adapter `{name}` has already been loaded.", "lora_name")

    def set_adapters(self, adapters: Iterable[Adapter]) -> None:
        """Replace the adapter table. An adapter of a model not served here is refused (ValueError)."""
        table: dict[str, Adapter] = {}
        for a in adapters:
            if a.base_model not in self._models:
                raise ValueError(f"LoRA adapter {a.lora.lora_name!r} names an unknown base model {a.base_model!r}.")
            if a.lora.lora_name in self._models or a.lora.lora_name in table:
                raise ValueError(f"LoRA adapter name {a.lora.lora_name!r} is already taken.")
            table[a.lora.lora_name] = a
        contexts = {
            n: self._adapter_contexts[n]
            if self._adapters.get(n) == a
            else self._models[a.base_model].with_adapter(a.lora)
            for n, a in table.items()
        }
        self._adapters, self._adapter_contexts = table, contexts

    def cards(self) -> list[ModelCard]:
        """`GET /v1/models`: every base model, then every adapter (`parent` its base model, `root` its path,
        as vLLM lists them; `quantization` raytp's own: an adapter's is its base model's)."""
        return [self.card(n) for n in self.names()]

    def card(self, name: str) -> ModelCard:
        """`GET /v1/models/{name}`; 404 for a name not served."""
        if name in self._models:
            ctx = self._models[name]
            return ModelCard(id=name, root=name, max_model_len=ctx.max_model_len, quantization=ctx.quantization)
        a = self._adapters.get(name)
        if a is None:
            raise model_not_found(name, self.names())
        base = self._models[a.base_model]
        return ModelCard(
            id=name,
            root=a.lora.lora_path,
            parent=a.base_model,
            max_model_len=base.max_model_len,
            quantization=base.quantization,
        )


class ModelsHandler:
    """Base of the route handlers (routes.py): the models one front door serves, over which each request's
    `model` picks its ServingContext (`ServedModels.resolve`); a single context stands for itself."""

    def __init__(self, models: ServedModels | ServingContext) -> None:
        self.models = ServedModels.of(models)
