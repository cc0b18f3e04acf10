"""Which quantization a model runs, decided once from the setting, the checkpoint and where it runs."""

from __future__ import annotations

import logging
from typing import Any

import torch

from model_exec.layers.quantization import fp8
from model_exec.layers.quantization.base import QuantizationConfig
from model_exec.layers.quantization.fp8_checkpoint import checkpoint_fp8
from model_exec.layers.quantization.gguf import GGUFConfig, kernels_available
from model_exec.layers.quantization.int8 import Int8Config

logger = logging.getLogger(__name__)


def select_quantization(
    setting: str | None,
    source_kind: str,
    device: torch.device,
    dtype: torch.dtype,
    checkpoint_config: dict[str, Any] | None = None,
) -> QuantizationConfig | None:
    """The config the model's layers are built under (None: float weights).

    `setting` is EngineConfig.quantization: None keeps a GGUF's blocks where they run (the CPU in float32 with
    the AVX2 kernel build; elsewhere the file loads dequantized, said in one log line) and loads any other
    checkpoint's floats; "none" loads float weights (a GGUF dequantized: the reference the kernels are tested
    against); "gguf" keeps a GGUF's blocks, refused by name where it cannot run (never a silent float fallback);
    "int8" quantizes a float checkpoint's linear layers at load (the same refusal). "fp8" quantizes them to FP8
    on a CUDA device of compute capability >= 8.9 in bfloat16 (`fp8.refusal` names why not elsewhere).

    `checkpoint_config` is config.json's `quantization_config`: a pre-quantized FP8 checkpoint runs as "fp8"
    whether the setting says so or is unset (vLLM's behaviour); any other setting, or a format raytp cannot
    load, is refused by name (`fp8_checkpoint.checkpoint_fp8`).

    Decision: a GGUF keeps its blocks by default, as vLLM runs a GGUF quantized. Each row's road through the
    block kernels is its kind's (`row_roads`: generated tokens the integer tiles, prompt tokens the dequantized
    panels), so a seeded sample does not follow its neighbours. Measured on the idle machine (docs/benchmarks.md,
    2026-11-29 10:26-11:05 UTC): one stream of the Q4_1 default decodes at 4.2x the dequantized fp32 and prefills
    at 0.96x; offline, 32 requests of 57-763 prompt tokens, 0.98x; served at 0.5 req/s, ITL p50 2.3x lower and
    TTFT p50 10% higher; the served process tree 0.78 GiB smaller."""
    prequantized = checkpoint_fp8(checkpoint_config)
    if prequantized is not None:
        if setting not in (None, "fp8"):
            raise ValueError(
                f"the checkpoint is quantized ({prequantized.describe}); quantization={setting!r} cannot load it: "
                "leave quantization unset or pass 'fp8'"
            )
        setting = "fp8"
    gguf_runs = device.type == "cpu" and dtype == torch.float32 and kernels_available()
    if setting is None and source_kind == "gguf":
        if gguf_runs:
            return GGUFConfig()
        logger.info(
            "GGUF weights load dequantized to %s: the block kernels run on the CPU in float32 (here: %s, %s)",
            dtype, device.type, dtype,
        )  # fmt: skip
        return None
    if setting in (None, "none"):
        return None
    if setting not in ("gguf", "int8", "fp8"):
        raise ValueError(f"quantization {setting!r} is not supported; supported: fp8, gguf, int8, none")
    if setting == "fp8":
        why = fp8.refusal(device, dtype)
        if why is not None:
            raise ValueError(f"quantization='fp8' cannot run here: {why}")
        return fp8.Fp8Config(prequantized)
    if setting == "int8":
        if not gguf_runs:
            where = f"{device.type}, {dtype}"
            raise ValueError(
                f"quantization='int8' runs on the CPU in float32 with the AVX2 kernel build; here: {where}"
            )
        return Int8Config()
    if setting == "gguf":
        if source_kind != "gguf":
            raise ValueError("quantization='gguf' needs a GGUF checkpoint")
        if not gguf_runs:
            where = f"{device.type}, {dtype}"
            raise ValueError(
                f"quantization='gguf' runs on the CPU in float32 with the AVX2 kernel build; here: {where}"
            )
        return GGUFConfig()
    raise AssertionError(setting)  # every setting is handled above
