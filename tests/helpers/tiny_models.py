"""Tiny random-weight Hugging Face models saved as safetensors dirs, and running our model on them.

The models are fp32 with "peaky" weights (large init range, randomised norms and
biases) so that greedy argmax has clear margins and float noise cannot flip it; every
parameter differs from its default so a mis-loaded weight changes the logits. Each
dir also gets a byte-level tokenizer (ids 0-2 are <unk>, <s>, </s>; 3-258 are bytes)
with a minimal chat template, so the engine can serve it end to end.

Head counts divide by 2 (Qwen2) or 4 (Llama variants) so the same dirs serve TP tests.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, TypeVar

import torch

from model_exec.parallel import TPGroup
from ops.attention.base import AttentionMetadata

T = TypeVar("T")

TOKENIZER_SIZE = 259  # 3 specials + 256 byte tokens; every tiny vocab is larger
BOS_ID, EOS_ID = 1, 2
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)

_LLAMA_DEFAULTS: dict[str, Any] = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=True,
    initializer_range=0.3,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
)
_QWEN2_DEFAULTS: dict[str, Any] = dict(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_word_embeddings=True,
    use_sliding_window=False,
    initializer_range=0.3,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
)
# Llama-3.1-style: untied head, llama3 rope scaling (all three frequency bands hit at head_dim 16),
# head_dim * heads != hidden_size, biases on attention (q, k, v and o) and MLP, vocab not divisible by 4.
_UNTIED_ROPE_SCALED_DEFAULTS: dict[str, Any] = dict(
    vocab_size=302,
    hidden_size=64,
    head_dim=16,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 4.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    tie_word_embeddings=False,
    attention_bias=True,
    mlp_bias=True,
    initializer_range=0.3,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
)


def tiny_llama_config(**overrides: Any) -> Any:
    """The HF config of make_tiny_llama's model (a transformers LlamaConfig), nothing saved."""
    from transformers import LlamaConfig

    return LlamaConfig(**{**_LLAMA_DEFAULTS, **overrides})


def make_tiny_llama(tmp_path: str | os.PathLike[str], seed: int = 0, **overrides: Any) -> str:
    """Tied-embedding GQA Llama (8 q / 4 kv heads, 2 layers); returns the saved dir."""
    return _make(Path(tmp_path) / "tiny-llama", tiny_llama_config(**overrides), seed)


def make_tiny_qwen2(tmp_path: str | os.PathLike[str], seed: int = 0, **overrides: Any) -> str:
    """Qwen2 (q/k/v bias, tied, 4 q / 2 kv heads); returns the saved dir."""
    from transformers import Qwen2Config

    return _make(Path(tmp_path) / "tiny-qwen2", Qwen2Config(**{**_QWEN2_DEFAULTS, **overrides}), seed)


def make_tiny_untied_rope_scaled(tmp_path: str | os.PathLike[str], seed: int = 0, **overrides: Any) -> str:
    """Untied Llama with llama3 rope scaling and all biases (pass rope_scaling=... for linear)."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(**{**_UNTIED_ROPE_SCALED_DEFAULTS, **overrides})
    return _make(Path(tmp_path) / "tiny-untied-rope-scaled", cfg, seed)


def make_tiny_model(path: str | os.PathLike[str], config: Any, seed: int = 0) -> str:
    """Any family's tiny model from its HF config object (e.g. transformers.Qwen3Config(...)), saved with
    peaky random weights and the byte tokenizer; returns the dir."""
    return _make(Path(path), config, seed)


def _make(path: Path, config: Any, seed: int) -> str:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    # the class transformers picked (Gemma3TextConfig's model is Gemma3ForCausalLM)
    model.config.architectures = [type(model).__name__]
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name == "model.norm.weight":  # x3 spreads the logits: wide greedy margins
                param.copy_(3.0 * (1.0 + 0.3 * torch.randn_like(param)))
            elif "norm" in name:
                param.copy_(1.0 + 0.3 * torch.randn_like(param))
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.3)
    model.save_pretrained(path)
    save_byte_tokenizer(path)
    return str(path)


def save_byte_tokenizer(path: str | os.PathLike[str]) -> None:
    """A byte-level BPE tokenizer without merges: one token per UTF-8 byte."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": BOS_ID, "</s>": EOS_ID}
    for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet())):
        vocab[ch] = 3 + i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="</s>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))


# ---- running our model without the engine ---------------------------------------------------


def prefill_inputs(
    prompts: list[list[int]],
    block_size: int,
    device: torch.device | str = "cpu",
    start: list[int] | None = None,
    end: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, int]:
    """Packed (input_ids, positions, metadata, num_blocks) for one prefill step.

    The step feeds tokens [start[i], end[i]) of prompt i (default: the whole prompt); tokens
    before start[i] must already be cached by an earlier step over the same prompts. Blocks
    are laid out from the full prompts, so every step agrees: row i owns a contiguous run of
    physical blocks after the rows before it, and block 0 is owned by no row, since 0 also
    pads the block tables' unused tail entries. num_blocks covers the full prompts.
    """
    lens = [len(p) for p in prompts]
    start = start or [0] * len(prompts)
    end = end or lens
    row_first = [1]
    for n in lens:
        row_first.append(row_first[-1] + -(-n // block_size))
    max_blocks = max(-(-e // block_size) for e in end)
    tables, slots, positions, ids, starts = [], [], [], [], [0]
    for i, prompt in enumerate(prompts):
        row = list(range(row_first[i], row_first[i] + -(-end[i] // block_size)))
        tables.append(row + [0] * (max_blocks - len(row)))
        slots += [row[p // block_size] * block_size + p % block_size for p in range(start[i], end[i])]
        positions += range(start[i], end[i])
        ids += prompt[start[i] : end[i]]
        starts.append(starts[-1] + end[i] - start[i])
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(end, dtype=torch.int32, device=device),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        max_query_len=max(e - s for s, e in zip(start, end, strict=True)),
        max_seq_len=max(end),
        num_decodes=0,
    )
    input_ids = torch.tensor(ids, dtype=torch.int64, device=device)
    return input_ids, torch.tensor(positions, dtype=torch.int64, device=device), meta, row_first[-1]


def make_kv_caches(
    config: Any,
    tp_size: int,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Zeroed per-layer (key, value) caches [num_blocks, block_size, kv_heads_per_rank, head_dim]."""
    shape = (num_blocks, block_size, config.num_key_value_heads // tp_size, config.head_dim)
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(config.num_hidden_layers)
    ]


def load_our_model(
    model: str | None, tp: TPGroup | None = None, device: str = "cpu", dtype: torch.dtype = torch.float32
) -> tuple[torch.nn.Module, Any]:
    """(our model shard with weights loaded, its ModelConfig) for a model name/path (None: default)."""
    from model_exec.models import build_model, pack_weights
    from model_exec.source import read_model_config, resolve_model
    from model_exec.weights import iter_weights
    from ops.attention import get_attn_backend

    tp = tp or TPGroup.single()
    src = resolve_model(model)
    config = read_model_config(src)
    net = build_model(config, tp, get_attn_backend("torch", device), device, dtype)
    net.load_weights(iter_weights(src))
    pack_weights(net)  # as the engine's ModelShard does: parity covers the packed (default) path
    return net, config


@torch.inference_mode()
def our_prefill_logits(
    net: torch.nn.Module,
    config: Any,
    prompts: list[list[int]],
    tp: TPGroup | None = None,
    block_size: int = 4,
    first_chunk: int | None = None,
    around_step: Callable[[Any], AbstractContextManager[Any]] | None = None,
) -> list[torch.Tensor] | None:
    """Per-prompt logits [len, vocab], batched; None on ranks other than 0.

    One prefill step by default; with `first_chunk`, two steps (chunked prefill): the first
    `first_chunk` tokens of every prompt, then the rest on top of the cached context. `around_step(meta)`: a
    context each step's forward runs in (the LoRA tests set the step's adapters so).
    """
    tp = tp or TPGroup.single()
    param = next(net.parameters())
    device, dtype = param.device, param.dtype
    lens = [len(p) for p in prompts]
    bounds = [[0] * len(prompts), lens]
    if first_chunk is not None:
        assert all(n > first_chunk > 0 for n in lens), "every prompt needs tokens in both steps"
        bounds.insert(1, [first_chunk] * len(prompts))
    caches: list[tuple[torch.Tensor, torch.Tensor]] = []
    pieces: list[list[torch.Tensor]] = [[] for _ in prompts]
    for begin, stop in itertools.pairwise(bounds):
        input_ids, positions, meta, num_blocks = prefill_inputs(prompts, block_size, device, begin, stop)
        caches = caches or make_kv_caches(config, tp.world_size, num_blocks, block_size, dtype, device)
        with around_step(meta) if around_step is not None else contextlib.nullcontext():
            logits = net.compute_logits(net(input_ids, positions, caches, meta))
        if logits is None:
            continue
        split = [e - b for b, e in zip(begin, stop, strict=True)]
        for row, part in enumerate(logits.float().cpu().split(split)):
            pieces[row].append(part)
    if tp.rank != 0:
        return None
    return [torch.cat(p) for p in pieces]


@functools.lru_cache(maxsize=1)
def hf_default_model() -> torch.nn.Module:
    """transformers' own fp32 load of the embedded SmolLM2 GGUF (an independent dequantiser).

    Cached per process: it takes ~20 s on 2 cores and several test files compare against it.
    """
    from transformers import AutoModelForCausalLM

    from model_exec.source import resolve_model

    src = resolve_model(None)
    model = AutoModelForCausalLM.from_pretrained(src.path, gguf_file=src.gguf_file, dtype=torch.float32)
    return model.eval()


@torch.inference_mode()
def hf_prefill_logits(hf_model: torch.nn.Module, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Reference logits from transformers, one unpadded forward per prompt."""
    return [hf_model(torch.tensor([p])).logits[0].float() for p in prompts]


def tp_prefill_worker(
    rank: int, world_size: int, init_method: str, model: str, prompts: list[list[int]], out_file: str
) -> None:
    """One TP rank of a real gloo group: load its shard, run the prefill; rank 0 saves the logits."""
    from model_exec.parallel import init_tp_group

    torch.set_num_threads(1)
    tp = init_tp_group(rank, world_size, init_method, "gloo", timeout_s=120)
    try:
        net, config = load_our_model(model, tp)
        logits = our_prefill_logits(net, config, prompts, tp)
        if rank == 0:
            assert logits is not None
            torch.save(logits, out_file)
        else:
            assert logits is None
    finally:
        tp.destroy()


# ---- simulated tensor parallelism: one thread per rank ------------------------------------------


class _ThreadWorld:
    """What the ranks of a simulated group share: a barrier and one mailbox slot per rank."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.barrier = threading.Barrier(world_size, timeout=60)
        self.slots: list[torch.Tensor | None] = [None] * world_size

    def exchange(self, rank: int, x: torch.Tensor) -> list[torch.Tensor]:
        self.slots[rank] = x
        self.barrier.wait()
        parts = [t for t in self.slots if t is not None]
        self.barrier.wait()  # nobody overwrites a slot before everyone has read it
        return parts


class ThreadTPGroup(TPGroup):
    """A TPGroup whose collectives run between threads of one process (rank order preserved)."""

    def __init__(self, rank: int, world: _ThreadWorld) -> None:
        super().__init__(rank, world.world_size)
        self.world = world

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        parts = self.world.exchange(self.rank, x.clone())
        total = parts[0].clone()
        for p in parts[1:]:
            total += p
        return x.copy_(total)

    def gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
        parts = self.world.exchange(self.rank, x)
        return torch.cat(parts, dim=dim) if self.rank == 0 else None


def run_in_rank_threads(world_size: int, fn: Callable[[TPGroup], T]) -> list[T]:
    """Run fn(tp) for every rank of a simulated group, one thread each; results in rank order.

    An exception on any rank aborts the barrier (so no rank hangs) and is re-raised.
    """
    world = _ThreadWorld(world_size)
    results: list[Any] = [None] * world_size
    errors: list[BaseException] = []

    def target(rank: int) -> None:
        try:
            results[rank] = fn(ThreadTPGroup(rank, world))
        except BaseException as e:
            errors.append(e)
            world.barrier.abort()

    threads = [threading.Thread(target=target, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:  # the failing rank's own error, not the BrokenBarrierError it caused elsewhere
        raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
    return results
