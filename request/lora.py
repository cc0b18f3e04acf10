"""LoRARequest: which LoRA adapter a request runs with, as vLLM's `vllm.lora.request.LoRARequest`.

    llm.generate(prompts, params, lora_request=LoRARequest("sql", 1, "/adapters/sql"))

`lora_int_id` is the adapter's identity everywhere below the front door: workers key the adapter's
weights by it, the scheduler counts distinct ids per step against `max_loras`, and the prefix cache
salts its block keys with it, so two adapters (or an adapter and the base model) never share KV blocks.
Torch-free: the HTTP ingress, the controller and the workers share it.
"""

from __future__ import annotations

from dataclasses import dataclass

from request.errors import RequestError

NO_LORA = 0  # the lora id of a request without an adapter (vLLM requires lora_int_id > 0)


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str  # what clients send as `model` to pick it
    lora_int_id: int  # > 0, unique per adapter in one engine
    lora_path: str  # a PEFT checkpoint folder: adapter_config.json + adapter_model.safetensors (or .bin)

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id <= NO_LORA:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}.")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty.")
        if not self.lora_path:
            raise ValueError(f"lora_path of adapter {self.lora_name!r} must not be empty.")


class LoRAError(RequestError):
    """An adapter that cannot be served (missing or malformed checkpoint, rank over max_lora_rank, a target
    module raytp cannot adapt, LoRA not enabled): a 400 whose message names the adapter and the cause."""

    def __init__(self, message: str, param: str | None = "lora_path", code: str | None = None) -> None:
        super().__init__(message, param, code)
