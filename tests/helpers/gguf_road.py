"""The two roads of the GGUF linear (ops/csrc/gguf_gemm.cpp): the integer tiles (x quantized per block) and,
from kDequantRows rows where the CPU has AVX-512F, W dequantized per chunk into fp32 FMA tiles
(ops/csrc/gguf_dequant_gemm.cpp). RAYTP_GGUF_DEQUANT_ROWS, read on every call, moves the threshold: the
tests force each road at every row count."""

from __future__ import annotations

import os

import pytest
import torch

DEQUANT_ROWS = 16  # gguf_dequant_gemm.h's kDequantRows

has_dequant_road = torch.backends.cpu.get_cpu_capability() == "AVX512" and "RAYTP_CPU_NO_AVX512" not in os.environ

ROADS = [
    "int",
    pytest.param(
        "dequant", marks=pytest.mark.skipif(not has_dequant_road, reason="the dequantizing road needs AVX-512F")
    ),
]


def take_road(monkeypatch: pytest.MonkeyPatch, road: str) -> None:
    """Every call runs `road` ("int" or "dequant") whatever its row count, until monkeypatch undoes it."""
    monkeypatch.setenv("RAYTP_GGUF_DEQUANT_ROWS", str(1 << 30) if road == "int" else "1")
