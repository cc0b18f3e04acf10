"""The controller's record of the LoRA adapters its workers hold, and the checks made before any worker loads one.

Decisions (vLLM's behaviour where it has one):
- `add` of an adapter already loaded (same id, name and path) is a no-op answering False; the same id with
  another name or path, or the same name under another id, is refused: an id names one adapter's weights on
  the workers and one family of prefix-cache keys, a name picks one adapter over HTTP. Remove it first.
- Every load of an id bumps its load generation, kept for the engine's life: the prefix cache salts an
  adapter's blocks with (id, generation), so an id re-used for other weights never hits the old blocks.
- The adapter's config (rank against max_lora_rank, targets, files present) is read here, before the
  workers are touched: a bad adapter is a fast LoRAError and no rank spends time on it.
Torch-free: the controller holds it.
"""

from __future__ import annotations

from model_exec.lora.peft_config import read_adapter_config
from scheduler.lora import LoRAError, LoRARequest

NOT_ENABLED = "LoRA is not enabled (start with enable_lora / --enable-lora)"


class LoadedAdapters:
    def __init__(self, enabled: bool, max_lora_rank: int) -> None:
        self.enabled = enabled
        self.max_lora_rank = max_lora_rank
        self._loaded: dict[int, LoRARequest] = {}  # lora_int_id -> the adapter every rank holds under it
        self._generations: dict[int, int] = {}  # lora_int_id -> loads of it so far (never reset)

    def check(self, lora: object) -> bool:
        """Raise LoRAError for an adapter that cannot be loaded; True when it still needs loading, False when
        this very adapter is loaded."""
        if not self.enabled:
            raise LoRAError(f"{NOT_ENABLED}; got a request for an adapter: {lora!r}.", "lora_request")
        if not isinstance(lora, LoRARequest):
            raise LoRAError(f"lora_request must be a LoRARequest, got {type(lora).__name__}.", "lora_request")
        known = self._loaded.get(lora.lora_int_id)
        if known == lora:
            return False
        if known is not None:
            raise LoRAError(
                f"lora_int_id {lora.lora_int_id} already names LoRA adapter {known.lora_name!r} at "
                f"{known.lora_path!r}, not {lora.lora_name!r} at {lora.lora_path!r}: remove it first.",
                "lora_int_id",
            )
        same_name = next((a for a in self._loaded.values() if a.lora_name == lora.lora_name), None)
        if same_name is not None:
            raise LoRAError(
                f"LoRA adapter name {lora.lora_name!r} is already loaded with lora_int_id {same_name.lora_int_id}, "
                f"not {lora.lora_int_id}: remove it first.",
                "lora_name",
            )
        read_adapter_config(lora, self.max_lora_rank)
        return True

    def register(self, lora: LoRARequest) -> None:
        """Every rank now holds `lora`."""
        self._loaded[lora.lora_int_id] = lora
        self._generations[lora.lora_int_id] = self._generations.get(lora.lora_int_id, 0) + 1

    def unregister(self, lora_int_id: int) -> LoRARequest | None:
        return self._loaded.pop(lora_int_id, None)

    def get(self, lora_int_id: int) -> LoRARequest | None:
        return self._loaded.get(lora_int_id)

    def generation(self, lora_int_id: int) -> int:
        """Which load of `lora_int_id` the ranks hold (1 for the first)."""
        return self._generations[lora_int_id]

    def list(self) -> list[LoRARequest]:
        return sorted(self._loaded.values(), key=lambda a: a.lora_int_id)

    def __contains__(self, lora_int_id: object) -> bool:
        return lora_int_id in self._loaded
