"""LoRAManager: one rank's resident LoRA adapters (keyed by lora_int_id) and the step context that applies them.

Built only with EngineConfig.enable_lora: it attaches a `LoRASlots` to every column- and row-parallel linear
layer of the model (all families build their projections from layers/linear.py); MoE experts (FusedMoE) and
replicated routers get none. Loading maps each PEFT module onto raytp's layers through the model's own
checkpoint table (`checkpoint_param`: q_proj -> qkv_proj part "q", Phi-3's fused qkv_proj -> all parts), so
an adapter follows exactly the layout the base weights were loaded with.

Adding is all-or-nothing: every tensor is read, checked and cut into this rank's shard before any layer
changes, so a LoRAError leaves the rank as it was.
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager

from model_exec.layers.linear import FUSED, ColumnParallelLinear, LinearBase, RowParallelLinear
from model_exec.lora.checkpoint import ModulePair, group_by_module, read_lora_tensors
from model_exec.lora.context import LoRAContext, StepLoRA
from model_exec.lora.peft_config import AdapterConfig, read_adapter_config
from model_exec.lora.sharding import Piece, column_weights, row_weights
from model_exec.lora.slots import LoRASlots, LoRAWeights
from model_exec.models.loading import CheckpointLoader
from request.lora import LoRAError, LoRARequest

logger = logging.getLogger(__name__)


class LoRAManager:
    def __init__(self, model: CheckpointLoader, max_loras: int, max_lora_rank: int) -> None:
        self.model = model
        self.max_loras = max_loras  # most distinct adapters in one step (the scheduler keeps to it)
        self.max_lora_rank = max_lora_rank
        self.context = LoRAContext()
        self.layers: dict[str, LinearBase] = {}  # raytp module name -> layer with `lora` attached
        self.hf_names: dict[str, list[str]] = {}  # raytp module name -> the HF module names stacked in it
        for name, module in model.named_modules():
            if ".experts" in name or not isinstance(module, ColumnParallelLinear | RowParallelLinear):
                continue
            if module.lora is not None:
                raise ValueError(f"{name} already has LoRA slots: one LoRAManager per model")
            module.lora = LoRASlots(name, self.context)
            self.layers[name] = module
            prefix, _, last = name.rpartition(".")
            parts = model.packed_modules_mapping.get(last, [last])
            self.hf_names[name] = [f"{prefix}.{p}" for p in parts]
        self.loaded: dict[int, LoRARequest] = {}

    # ------------------------------------------------------------------ adapters
    def add(self, lora: LoRARequest) -> None:
        """Load `lora` (replacing an adapter with the same id) or raise LoRAError with nothing changed."""
        where = f"LoRA adapter {lora.lora_name!r}"
        config = read_adapter_config(lora, self.max_lora_rank)
        try:
            tensors = read_lora_tensors(config.weights_file)
        except LoRAError as e:
            raise LoRAError(f"{where}: {e}") from None
        weights = self._build(group_by_module(tensors, where), config, where)
        with self.context.between_steps():  # commit: nothing below raises
            for name, layer in self.layers.items():
                assert layer.lora is not None
                if name in weights:
                    layer.lora.adapters[lora.lora_int_id] = weights[name]
                else:
                    layer.lora.adapters.pop(lora.lora_int_id, None)
            self.loaded[lora.lora_int_id] = lora
        size = sum(w.nbytes for w in weights.values())
        logger.info(
            "loaded %s (id %d, rank %d): %d layers, %.1f MiB",
            *(where, lora.lora_int_id, config.rank, len(weights), size / 2**20),
        )

    def remove(self, lora_int_id: int) -> bool:
        with self.context.between_steps():
            if self.loaded.pop(lora_int_id, None) is None:
                return False
            for layer in self.layers.values():
                assert layer.lora is not None
                layer.lora.adapters.pop(lora_int_id, None)
            return True

    def lora_ids(self) -> list[int]:
        return sorted(self.loaded)

    # ------------------------------------------------------------------ steps
    def batch(self, row_lora_ids: list[int], starts: list[int]) -> AbstractContextManager[StepLoRA | None]:
        """The context to run one forward in: its rows' adapters (`step`) set for the LoRA layers."""
        return self.context.use(lambda: self.step(row_lora_ids, starts))

    def step(self, row_lora_ids: list[int], starts: list[int]) -> StepLoRA | None:
        """The step's token groups (`StepLoRA.from_rows`), after checking every adapter named is loaded and
        that the step holds at most max_loras of them (the controller never sends otherwise)."""
        step = StepLoRA.from_rows(row_lora_ids, starts)
        if step is None:
            return None
        unknown = [i for i in step.lora_ids if i not in self.loaded]
        if unknown:
            raise ValueError(f"the step runs LoRA adapter ids {unknown}, which are not loaded on this rank")
        if len(step.lora_ids) > self.max_loras:
            raise ValueError(f"the step runs {len(step.lora_ids)} LoRA adapters, over max_loras={self.max_loras}")
        return step

    # ------------------------------------------------------------------ loading
    def _build(self, pairs: dict[str, ModulePair], config: AdapterConfig, where: str) -> dict[str, LoRAWeights]:
        """This rank's weights for every layer the adapter touches, raytp module name -> weights."""
        model_names = {hf for names in self.hf_names.values() for hf in names}
        known = {hf.rpartition(".")[2] for hf in model_names}
        lacking = sorted(config.target_modules - known)
        if lacking:
            raise LoRAError(f"{where}: the model has no module named {', '.join(lacking)} (it has {sorted(known)})")
        pieces: dict[str, list[Piece]] = {}
        for hf_module, pair in sorted(pairs.items()):
            name, part_ids = self._place(hf_module, config, where)
            pieces.setdefault(name, []).append(Piece(hf_module, part_ids, pair))
        for hf in sorted(model_names):  # every module a target names has its weights
            if config.targets(hf) and hf not in pairs:
                raise LoRAError(f"{where}: no weights for {hf}, which target_modules names")
        built: dict[str, LoRAWeights] = {}
        for name, layer_pieces in pieces.items():
            layer = self.layers[name]
            if isinstance(layer, RowParallelLinear):
                (piece,) = layer_pieces  # a row-parallel layer is never stacked
                built[name] = row_weights(layer, name, piece, config.rank, config.scaling, where)
            else:
                assert isinstance(layer, ColumnParallelLinear)
                built[name] = column_weights(layer, name, layer_pieces, config.rank, config.scaling, where)
        return built

    def _place(self, hf_module: str, config: AdapterConfig, where: str) -> tuple[str, tuple[str | int | None, ...]]:
        """(raytp module name, the parts of it that `hf_module` covers), or LoRAError naming the module."""
        if ".experts." in f"{hf_module}.":
            raise LoRAError(f"{where}: {hf_module} is inside a MoE layer's experts, which LoRA does not adapt here")
        if not config.targets(hf_module):
            raise LoRAError(f"{where}: weights for {hf_module}, but target_modules does not name it")
        target = self.model.checkpoint_param(f"{hf_module}.weight")
        name = target[0].removesuffix(".weight") if target is not None else None
        if name is None or name not in self.layers:
            raise LoRAError(f"{where}: the model has no module {hf_module} that LoRA can adapt")
        assert target is not None
        layer = self.layers[name]
        part_ids = [sid for sid, _, _ in layer.output_parts()] if isinstance(layer, ColumnParallelLinear) else [None]
        shard_id = target[1]
        if shard_id == FUSED and len(part_ids) > 1:
            return name, tuple(part_ids)
        if shard_id in part_ids:
            assert not isinstance(shard_id, tuple)  # expert shard ids were refused above
            return name, (shard_id,)
        stored = ", ".join(self.hf_names[name])
        raise LoRAError(f"{where}: the model has no module {hf_module} (its checkpoint stores {stored})")
