"""`quantization="fp8"` (issue 39 item 3): FP8 weights per output channel, activations per token, `_scaled_mm`.

- the scaling arithmetic: scales exact for known inputs, values within fp8 e4m3's rounding of the floats;
- the product (`fp8_linear`, the real `torch._scaled_mm`, which torch's CPU build runs with rowwise scales)
  equals its emulation (both operands dequantized, fp32 matmul) to bf16 output rounding, on the CPU and on
  CUDA where there is one;
- a tiny bf16 Llama built under `Fp8Config` (on the CPU: the device check lives in `select_quantization`,
  which refuses the CPU) follows the bf16 model, at TP 1 and simulated TP 2, with LoRA on top;
- pre-quantized checkpoints written here (compressed-tensors and `quant_method: fp8`, per-channel and
  per-tensor scales, static and dynamic activations) load to exactly the written weights times their scales,
  TP-sharded; unsupported formats and devices are refused by name;
- CUDA only: the engine end to end, greedy tokens and logprobs against the bf16 model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from model_exec.layers.linear import LinearBase
from model_exec.layers.quantization import scope
from model_exec.layers.quantization.fp8 import (
    FP8,
    FP8_MAX,
    Fp8Config,
    Fp8LinearMethod,
    fp8_linear,
    quantize_per_channel,
    quantize_per_token,
)
from model_exec.layers.quantization.fp8_checkpoint import checkpoint_fp8
from model_exec.layers.quantization.select import select_quantization
from model_exec.models import build_model, pack_weights
from model_exec.parallel import TPGroup
from model_exec.source import read_model_config, resolve_model
from model_exec.weights import iter_weights
from ops.attention import get_attn_backend
from tests.helpers.family_parity import PREFILL_PROMPTS
from tests.helpers.tiny_models import make_tiny_llama, our_prefill_logits, run_in_rank_threads

BF16 = torch.bfloat16
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _within_fp8_rounding(back: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor) -> bool:
    """e4m3 keeps 3 mantissa bits: a normal value rounds within 2^-4 of itself, a subnormal within half
    the smallest step (2^-10 of the scale)."""
    return bool(torch.all((back - ref).abs() <= ref.abs() * 2**-4 + scale * 2**-10 + 1e-12))


# ---- arithmetic ----------------------------------------------------------------------------------


def test_per_channel_scales_are_row_amax_over_448() -> None:
    w = torch.randn(6, 64) * torch.logspace(-3, 2, 6).unsqueeze(1)  # rows of very different magnitude
    w[1, 5] = -896.0  # row 1's amax: its scale is exactly 2
    w[3] = 0.0  # an all-zero row: the floor scale, values 0
    q, scale = quantize_per_channel(w)
    assert q.dtype == FP8 and q.is_contiguous() and scale.shape == (6, 1) and scale.dtype == torch.float32
    assert scale[1, 0] == 2.0 and q[1, 5].float() == -FP8_MAX
    assert torch.equal(scale, (w.abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=1e-12))
    back = q.float() * scale
    assert torch.equal(back[3], torch.zeros(64))
    assert _within_fp8_rounding(back, w, scale)
    assert torch.equal(q.float().abs().amax(-1)[[0, 1, 2, 4, 5]], torch.full((5,), FP8_MAX))  # amax hits 448


def test_per_token_scales_dynamic_and_static() -> None:
    x = torch.randn(5, 32, dtype=BF16) * 3
    x[2] = 0
    x[4, 0] = 44.8  # bf16 rounds it; the scale is its rounded value / 448
    q, scale = quantize_per_token(x)
    assert scale.shape == (5, 1) and scale[2, 0] == 1e-12
    assert scale[4, 0] == x[4].float().abs().max() / FP8_MAX
    assert _within_fp8_rounding(q.float() * scale, x.float(), scale)
    static = torch.tensor(0.05)
    qs, ss = quantize_per_token(x, static)
    assert torch.equal(ss, torch.full((5, 1), 0.05))
    assert torch.equal(qs.float(), (x.float() / 0.05).clamp(-FP8_MAX, FP8_MAX).to(FP8).float())  # saturates


def _emulated(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """What `_scaled_mm` computes, spelled out: both operands dequantized, the product in fp32."""
    q, scale = quantize_per_channel(weight)
    rows = x.reshape(-1, x.shape[-1])
    xq, sa = quantize_per_token(rows)
    y = (xq.float() * sa) @ (q.float() * scale).t()
    y = y if bias is None else y + bias.float()
    return y.view(*x.shape[:-1], weight.shape[0])


def _scaled_mm_runs(device: str) -> bool:
    a = torch.zeros(16, 16, device=device).to(FP8)
    one = torch.ones(16, 1, device=device)
    try:
        torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one.t().contiguous(), out_dtype=BF16)
    except (RuntimeError, NotImplementedError):
        return False
    return True


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_scaled_mm_equals_its_emulation(device: str, with_bias: bool) -> None:
    if not _scaled_mm_runs(device):
        pytest.skip(f"this torch's {device} build has no rowwise-scaled _scaled_mm")
    torch.manual_seed(0)
    w = torch.randn(48, 64, dtype=BF16, device=device)
    x = torch.randn(2, 3, 64, dtype=BF16, device=device)  # leading dims: reshaped to 2-D and back
    bias = torch.randn(48, dtype=BF16, device=device) if with_bias else None
    q, scale = quantize_per_channel(w)
    y = fp8_linear(x, q.t(), scale.reshape(1, -1).contiguous(), bias)
    ref = _emulated(x, w, bias)
    assert y.shape == (2, 3, 48) and y.dtype == BF16
    # the only difference: fp32 accumulation order and the bf16 rounding of the output
    torch.testing.assert_close(y.float(), ref, atol=1e-2, rtol=2**-7)
    exact = x.float() @ w.float().t() + (0 if bias is None else bias.float())
    assert float((y.float() - exact).abs().max() / exact.abs().max()) < 0.08  # fp8 on both operands


# ---- the refusals --------------------------------------------------------------------------------


def test_fp8_is_refused_by_name_off_ada_and_hopper(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"quantization='fp8' cannot run here: .*CUDA.*here: cpu"):
        select_quantization("fp8", "safetensors", torch.device("cpu"), BF16)
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match=r"8\.9 or higher.*has 8\.0"):
        select_quantization("fp8", "safetensors", cuda, BF16)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    with pytest.raises(ValueError, match="dtype='bfloat16'.*float16"):
        select_quantization("fp8", "safetensors", cuda, torch.float16)
    assert isinstance(select_quantization("fp8", "safetensors", cuda, BF16), Fp8Config)
    ct = _compressed_tensors_config("channel", static=False)
    chosen = select_quantization(None, "safetensors", cuda, BF16, ct)  # a pre-quantized checkpoint: fp8 as in vLLM
    assert isinstance(chosen, Fp8Config) and chosen.checkpoint is not None and not chosen.checkpoint.static_input
    with pytest.raises(ValueError, match="checkpoint is quantized.*'int8' cannot load it"):
        select_quantization("int8", "safetensors", torch.device("cpu"), torch.float32, ct)
    with pytest.raises(ValueError, match="cannot run here"):  # refused on the CPU, checkpoint or not
        select_quantization(None, "safetensors", torch.device("cpu"), BF16, ct)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "block-wise FP8"),
        ({"quant_method": "fp8", "ignored_layers": ["model.layers.0.mlp.down_proj"]}, "keep linear layers in float"),
        ({"quant_method": "fp8", "kv_cache_scheme": {"num_bits": 8}}, "kv_cache_scheme"),
        ({"quant_method": "awq", "bits": 4}, "quantization 'awq' is not supported"),
        ({"quant_method": "compressed-tensors", "format": "pack-quantized"}, "format 'pack-quantized'"),
        ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {}}, "0 config groups"),
    ],
)
def test_unsupported_checkpoint_formats_are_refused_by_name(config: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        checkpoint_fp8(config)


def test_compressed_tensors_schemes() -> None:
    assert checkpoint_fp8(_compressed_tensors_config("tensor", static=True)).static_input  # type: ignore[union-attr]
    group = _compressed_tensors_config("group", static=False)
    with pytest.raises(ValueError, match="per group"):
        checkpoint_fp8(group)
    weight_only = _compressed_tensors_config("channel", static=False)
    del weight_only["config_groups"]["group_0"]["input_activations"]
    with pytest.raises(ValueError, match="weight-only"):
        checkpoint_fp8(weight_only)


@pytest.mark.parametrize("prequantized", [False, True])
def test_a_layer_not_a_multiple_of_16_stays_in_float(prequantized: bool) -> None:
    from model_exec.layers.linear import ColumnParallelLinear

    ckpt = checkpoint_fp8({"quant_method": "fp8"}) if prequantized else None
    with scope(Fp8Config(ckpt)):
        layer = ColumnParallelLinear(24, 40, bias=False, tp=TPGroup.single(), params_dtype=BF16)
    w = torch.randn(40, 24, dtype=BF16)
    if prequantized:
        q, scale = quantize_per_channel(w)
        layer.weight_loader(layer.weight, q)
        layer.weight_scale.weight_loader(layer.weight_scale, scale)  # type: ignore[operator]
        w = (q.float() * scale).to(BF16)
    else:
        layer.weight_loader(layer.weight, w)
    assert not layer.pack_weights() and not layer.pack_weights()  # twice: the second changes nothing
    method = layer.quant_method
    assert isinstance(method, Fp8LinearMethod) and method.weight_t is None
    x = torch.randn(3, 24, dtype=BF16)
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, w))


# ---- models --------------------------------------------------------------------------------------


def _load(path: str, quant: Fp8Config | None, tp: TPGroup | None = None) -> tuple[torch.nn.Module, Any]:
    src = resolve_model(path)
    config = read_model_config(src)
    with scope(quant):
        net = build_model(config, tp or TPGroup.single(), get_attn_backend("torch", "cpu"), "cpu", BF16)
    net.load_weights(iter_weights(src))  # type: ignore[operator]
    pack_weights(net)  # type: ignore[arg-type]
    return net, config


class EmulatedFp8Method(Fp8LinearMethod):
    """The same weights and scales, the product spelled out (`_emulated`'s arithmetic): the reference the
    model's `_scaled_mm` layers must equal."""

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        assert self.weight_t is not None
        xq, scale = quantize_per_token(x.reshape(-1, x.shape[-1]), self.input_scale)
        y = (xq.float() * scale) @ self.dequantized().t()
        y = y if bias is None else y + bias.float()
        return y.to(x.dtype).view(*x.shape[:-1], -1)


class EmulatedFp8Config(Fp8Config):
    def linear_method(self) -> Fp8LinearMethod:
        return EmulatedFp8Method(self.checkpoint)


def _methods(net: torch.nn.Module) -> dict[str, Fp8LinearMethod]:
    out = {name: m.quant_method for name, m in net.named_modules() if isinstance(m, LinearBase)}
    assert out and all(isinstance(m, Fp8LinearMethod) and m.weight_t is not None for m in out.values())
    return out  # type: ignore[return-value]


def _cosine_min(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return min(float(torch.nn.functional.cosine_similarity(x, y, dim=-1).min()) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    # a realistic init (0.02, not the tiny models' peaky 0.3): fp8 e4m3 keeps 3 mantissa bits, and the peaky
    # weights amplify each layer's rounding until the logits are noise (cosine 0.78 at 0.3, 0.997 at 0.02)
    return make_tiny_llama(tmp_path_factory.mktemp("fp8-llama"), initializer_range=0.02)


@pytest.fixture(scope="module")
def bf16_logits(llama: str) -> list[torch.Tensor]:
    net, config = _load(llama, None)
    out = our_prefill_logits(net, config, PREFILL_PROMPTS)
    assert out is not None
    return out


@pytest.mark.skipif(not _scaled_mm_runs("cpu"), reason="this torch's CPU build has no rowwise-scaled _scaled_mm")
def test_fp8_model_follows_the_bf16_model(llama: str, bf16_logits: list[torch.Tensor]) -> None:
    net, config = _load(llama, Fp8Config())
    reference, _ = _load(llama, None)
    floats = {n: m.weight for n, m in reference.named_modules() if isinstance(m, LinearBase)}
    for name, method in _methods(net).items():
        q, scale = quantize_per_channel(floats[name].data)
        assert torch.equal(method.dequantized(), q.float() * scale)  # each rank's rows, quantized per channel
        layer = net.get_submodule(name)
        assert layer.weight.stride() == (0, 0) and layer.weight.dtype == BF16  # the float matrix is released
    ours = our_prefill_logits(net, config, PREFILL_PROMPTS)
    emulated = our_prefill_logits(*_load(llama, EmulatedFp8Config()), PREFILL_PROMPTS)
    assert ours is not None and emulated is not None
    for a, b in zip(ours, emulated, strict=True):  # the plumbing: exactly the spelled-out product
        torch.testing.assert_close(a, b, atol=1e-2, rtol=2**-7)
    assert _cosine_min(ours, bf16_logits) > 0.99

    def rank(tp: TPGroup) -> list[torch.Tensor] | None:
        sharded, cfg = _load(llama, Fp8Config(), tp)
        return our_prefill_logits(sharded, cfg, PREFILL_PROMPTS, tp=tp)

    got = run_in_rank_threads(2, rank)[0]
    assert got is not None and _cosine_min(got, ours) > 0.995


@pytest.mark.skipif(not _scaled_mm_runs("cpu"), reason="this torch's CPU build has no rowwise-scaled _scaled_mm")
def test_lora_adds_on_top_of_fp8(llama: str, tmp_path: Path) -> None:
    from model_exec.lora.manager import LoRAManager
    from request.lora import LoRARequest
    from tests.helpers.lora_models import hf_merged_model, make_peft_adapter, our_lora_prefill_logits
    from tests.helpers.tiny_models import hf_prefill_logits

    adapter = make_peft_adapter(llama, tmp_path / "adapter", rank=8, seed=1)
    net, config = _load(llama, Fp8Config())
    manager = LoRAManager(net, max_loras=1, max_lora_rank=16)  # type: ignore[arg-type]
    manager.add(LoRARequest("a", 1, adapter))
    ours = our_lora_prefill_logits(net, manager, config, PREFILL_PROMPTS, [1] * len(PREFILL_PROMPTS))
    merged = hf_prefill_logits(hf_merged_model(llama, adapter), PREFILL_PROMPTS)
    base = our_prefill_logits(net, config, PREFILL_PROMPTS)
    assert ours is not None and base is not None
    for o, m, b in zip(ours, merged, base, strict=True):
        # the adapter moves the fp8 model's logits most of the way to the merged float model's
        assert float((o - m).abs().max()) < 0.5 * float((b - m).abs().max())


# ---- pre-quantized checkpoints --------------------------------------------------------------------


def _compressed_tensors_config(strategy: str, static: bool) -> dict[str, Any]:
    inputs = {"num_bits": 8, "type": "float", "symmetric": True}
    inputs |= {"strategy": "tensor", "dynamic": False} if static else {"strategy": "token", "dynamic": True}
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy, "dynamic": False}
    group = {"targets": ["Linear"], "weights": weights, "input_activations": inputs}
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {"group_0": group},
        "ignore": ["lm_head"],
    }


def _write_fp8_checkpoint(src: str, dst: Path, fmt: str, strategy: str, static: bool) -> dict[str, torch.Tensor]:
    """The float checkpoint `src` with every linear weight in fp8 (its scale per channel or per tensor), as
    llm-compressor / AutoFP8 write them. Returns the dequantized weights the model must end up with."""
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    for f in Path(src).iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(Path(src) / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    expected: dict[str, torch.Tensor] = {}
    torch.manual_seed(1)
    for name, t in tensors.items():
        module = name.removesuffix(".weight")
        if not name.endswith(".weight") or module.rpartition(".")[2] not in LINEARS:
            out[name] = t
            continue
        if strategy == "channel":
            q, scale = quantize_per_channel(t)
        else:
            scale = t.abs().amax().float().reshape(()) / FP8_MAX
            q = (t.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        out[name], out[f"{module}.weight_scale"] = q, scale
        if static:
            out[f"{module}.input_scale"] = torch.rand(()) * 0.05 + 0.01
        expected[module] = q.float() * (scale if scale.dim() else scale.expand(t.shape[0], 1))
    save_file(out, str(dst / "model.safetensors"))
    config = json.loads((dst / "config.json").read_text())
    if fmt == "compressed-tensors":
        config["quantization_config"] = _compressed_tensors_config(strategy, static)
    else:
        config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "static" if static else "dynamic"}
    (dst / "config.json").write_text(json.dumps(config))
    return expected


def _fused(expected: dict[str, torch.Tensor], layer: str, tp: TPGroup) -> torch.Tensor:
    """The rows of fused layer `layer` (as ours names it) on rank `tp.rank`: each part's rank slice, stacked."""
    parts = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    prefix, _, leaf = layer.rpartition(".")
    rows = []
    for part in parts.get(leaf, (leaf,)):
        full = expected[f"{prefix}.{part}"]
        if leaf in ("o_proj", "down_proj"):  # row-parallel: the input features are cut
            rows.append(full.chunk(tp.world_size, dim=1)[tp.rank])
        else:
            rows.append(full.chunk(tp.world_size, dim=0)[tp.rank])
    return torch.cat(rows)


@pytest.mark.skipif(not _scaled_mm_runs("cpu"), reason="this torch's CPU build has no rowwise-scaled _scaled_mm")
@pytest.mark.parametrize(
    ("fmt", "strategy", "static"),
    [
        ("compressed-tensors", "channel", False),  # llm-compressor's FP8_DYNAMIC
        ("compressed-tensors", "tensor", True),  # llm-compressor's FP8 (neuralmagic's Llama-3-*-FP8)
        ("fp8", "tensor", False),  # AutoFP8 / vLLM's fp8 dynamic
        ("fp8", "tensor", True),
    ],
)
def test_prequantized_checkpoint_loads_its_weights_and_scales(
    llama: str, bf16_logits: list[torch.Tensor], tmp_path: Path, fmt: str, strategy: str, static: bool
) -> None:
    expected = _write_fp8_checkpoint(llama, tmp_path / "fp8", fmt, strategy, static)
    path = str(tmp_path / "fp8")
    ckpt = checkpoint_fp8(read_model_config(resolve_model(path)).hf["quantization_config"])
    assert ckpt is not None and ckpt.static_input == static

    def rank(tp: TPGroup) -> list[torch.Tensor] | None:
        net, config = _load(path, Fp8Config(ckpt), tp)
        for name, method in _methods(net).items():
            assert torch.equal(method.dequantized(), _fused(expected, name, tp)), name
            assert (method.input_scale is not None) == static
            layer = net.get_submodule(name)
            assert layer.weight.dtype == BF16 and layer.weight.stride() == (0, 0)  # fp8 bytes live in weight_t
        return our_prefill_logits(net, config, PREFILL_PROMPTS, tp=tp)

    single = rank(TPGroup.single())
    emulated = our_prefill_logits(*_load(path, EmulatedFp8Config(ckpt)), PREFILL_PROMPTS)
    assert single is not None and emulated is not None
    for a, b in zip(single, emulated, strict=True):
        torch.testing.assert_close(a, b, atol=1e-2, rtol=2**-7)
    assert _cosine_min(single, bf16_logits) > 0.99
    sharded = run_in_rank_threads(2, rank)[0]
    assert sharded is not None and _cosine_min(sharded, single) > 0.995


def test_a_float_tensor_where_the_checkpoint_promises_fp8_is_refused(llama: str, tmp_path: Path) -> None:
    path = tmp_path / "mislabelled"
    path.mkdir()
    for f in Path(llama).iterdir():
        (path / f.name).write_bytes(f.read_bytes())
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8"}
    (path / "config.json").write_text(json.dumps(config))
    ckpt = checkpoint_fp8(config["quantization_config"])
    with pytest.raises(ValueError, match=r"FP8 checkpoint \(fp8, dynamic activations\) holds torch.float32"):
        _load(str(path), Fp8Config(ckpt))


# ---- CUDA end to end -----------------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device of compute capability >= 8.9")
def test_engine_fp8_greedy_follows_bf16_on_cuda(llama: str) -> None:
    from benchmarks.fp8_check import compare_fp8_with_bf16

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 products need compute capability 8.9 or higher")
    prompts = [p for p in PREFILL_PROMPTS if len(p) > 1]
    # a fixed small pool: sized by memory, a tiny model's pool would be millions of blocks
    report = compare_fp8_with_bf16(llama, prompts, max_tokens=16, max_model_len=256, num_gpu_blocks_override=4096)
    print("fp8 vs bf16:", report)  # the figures: token agreement and logprob differences
    assert report["quantization"] == "fp8" and report["bf16"]["quantization"] == "none"
    assert not report["mismatch"], report  # vLLM's check_logprobs_close: a divergence stays within the top 5
    assert report["first_token_agreement"] >= 0.75, report


def test_the_engine_refuses_fp8_on_the_cpu_at_start(llama: str, tmp_path: Path) -> None:
    """Through the engine's own road (config -> worker -> ModelShard -> select_quantization): the setting, and a
    pre-quantized checkpoint's config.json alone, are refused by name on the CPU, never loaded as floats."""
    from raytp import LLM

    with pytest.raises(ValueError, match="quantization='fp8' cannot run here"):
        LLM(llama, quantization="fp8", dtype="bfloat16", distributed_executor_backend="inprocess")
    _write_fp8_checkpoint(llama, tmp_path / "ct", "compressed-tensors", "channel", static=False)
    with pytest.raises(ValueError, match="quantization='fp8' cannot run here"):
        LLM(str(tmp_path / "ct"), dtype="bfloat16", distributed_executor_backend="inprocess")


@pytest.mark.skipif(not _scaled_mm_runs("cpu"), reason="this torch's CPU build has no rowwise-scaled _scaled_mm")
def test_the_engine_road_with_fp8_on_the_cpu_build_of_scaled_mm(llama: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole engine with quantization='fp8' (select, load, pack, the profile and decode steps) and
    benchmarks/fp8_check's comparison, on the CPU build of `_scaled_mm` with the device check lifted: the
    CPU road the CUDA one shares everything but the device with."""
    import benchmarks.fp8_check as check
    from model_exec.layers.quantization import fp8
    from raytp import LLM

    monkeypatch.setattr(fp8, "refusal", lambda device, dtype: None)
    monkeypatch.setattr(check, "_llm", lambda model, **kw: LLM(model, distributed_executor_backend="inprocess", **kw))
    prompts = [p for p in PREFILL_PROMPTS if len(p) > 1]
    report = check.compare_fp8_with_bf16(llama, prompts, max_tokens=8, max_model_len=256)
    print("fp8 vs bf16 (CPU _scaled_mm):", report)
    assert report["quantization"] == "fp8" and report["bf16"]["quantization"] == "none"
    assert report["sequences"] == len(prompts) and not report["mismatch"], report
    assert report["first_token_agreement"] >= 0.75 and report["max_logprob_diff_where_agreeing"] < 0.5, report
