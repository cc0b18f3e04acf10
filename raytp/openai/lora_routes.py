"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter: vLLM's runtime LoRA routes.

What they do to the engines is the deployment's business (`LoRAAdmin`: raytp/serve/lora_admin.py makes
the change reach every replica of the model); what a client may ask is decided here, against the names
the front door serves (`ServedModels`). Decision: with runtime updating off (the default, as vLLM's
VLLM_ALLOW_RUNTIME_LORA_UPDATING) the routes still exist and answer 404, as vLLM's absent routes do, but
with a message saying how to turn them on instead of a bare "Not found". They are not batch routes.
"""

from __future__ import annotations

from typing import Protocol

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from starlette.responses import Response

from raytp.openai.errors import OpenAIError, bad_request
from raytp.openai.models import ServedModels
from raytp.openai.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest

RUNTIME_LORA_OFF = (
    "Runtime LoRA updating is off: start the server with --enable-runtime-lora-updating "
    "(or VLLM_ALLOW_RUNTIME_LORA_UPDATING=True) to load and unload adapters."
)


class LoRAAdmin(Protocol):
    async def load(self, lora_name: str, lora_path: str, base_model: str) -> None:
        """Load the adapter for `base_model` and make it servable under `lora_name` on every replica.
        Raises LoRAError (a 400 naming it) when the checkpoint cannot be served, OpenAIError for a name
        taken meanwhile; nothing is registered then."""
        ...

    async def unload(self, lora_name: str) -> None:
        """Stop serving the adapter everywhere; OpenAIError 404 when no adapter has that name."""
        ...


def add_lora_routes(app: FastAPI, models: ServedModels, admin: LoRAAdmin | None) -> None:
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> Response:
        if admin is None:
            raise OpenAIError(RUNTIME_LORA_OFF, 404, "invalid_request_error", code="runtime_lora_updating_disabled")
        models.check_free(body.lora_name)
        await admin.load(body.lora_name, body.lora_path, _base_model(models, body.base_model_name))
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> Response:
        if admin is None:
            raise OpenAIError(RUNTIME_LORA_OFF, 404, "invalid_request_error", code="runtime_lora_updating_disabled")
        if body.lora_name in models.base_names:
            raise bad_request(f"`{body.lora_name}` is a base model, not a LoRA adapter.", "lora_name")
        await admin.unload(body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def _base_model(models: ServedModels, name: str | None) -> str:
    """The model a new adapter adapts: the one named, or the only model with LoRA enabled."""
    enabled = [n for n in models.base_names if models.context(n).enable_lora]
    if name is not None:
        if name not in models.base_names:
            raise bad_request(
                f"base_model_name `{name}` is not a served model ({', '.join(models.base_names)}).", "base_model_name"
            )
        if name not in enabled:
            raise bad_request(f"The model `{name}` was not started with enable_lora.", "base_model_name")
        return name
    if len(enabled) == 1:
        return enabled[0]
    if not enabled:
        raise bad_request("No served model was started with enable_lora.", "lora_name")
    raise bad_request(
        f"base_model_name is required: several models serve LoRA adapters ({', '.join(enabled)}).", "base_model_name"
    )


def unknown_adapter(name: str) -> OpenAIError:
    return OpenAIError(
        f"The LoRA adapter `{name}` cannot be found.", 404, "invalid_request_error", "lora_name", "lora_not_found"
    )
