"""The pooling runner on the engine's side (torch-free): which runner a model gets, the scheduling a pooling
engine runs with, and the checks a pooling request passes.

A pooling request is one forward over its whole prompt through the same scheduler and batching as
generation: admitted FCFS under the step's token budget (`max_num_batched_tokens`) and row budget
(`max_num_seqs`), its prompt's blocks allocated, the step run, and the sequence finished on the step's
pooled result, which frees its blocks at once. So a pooling engine runs without chunked prefill (an
encoder attends in both directions: a prompt cut in two would see half of itself) and without prefix
caching (a prompt whose prefix was cached would skip the tokens the pooler must read), and its KV pool
holds one step: nothing outlives the step that wrote it.
"""

from __future__ import annotations

from typing import Any, Literal

from cluster.config import EngineConfig
from model_exec.config import ModelConfig
from model_exec.pooling_config import num_labels, pooling_max_len, pooling_task
from request.check import RequestLimits
from request.errors import PromptTooLongError, RequestError
from request.pooling_params import PoolingParams

# Tokens per pooling step unless the user sets max_num_batched_tokens: a batch of whole prompts (64
# texts of 128 tokens). Larger steps batch more rows per GEMM; the activations grow with it.
_DEFAULT_POOLING_BUDGET = 8192


def resolve_runner(config: EngineConfig, model_config: ModelConfig) -> Literal["generate", "pooling"]:
    """"generate" or "pooling"; ValueError when the model cannot run the one asked for."""
    task = pooling_task(model_config.architecture)
    auto: Literal["generate", "pooling"] = "generate" if task == "generate" else "pooling"
    runner = auto if config.runner == "auto" else config.runner
    if runner == "generate" and task != "generate":
        raise ValueError(
            f"{model_config.architecture} is a pooling model ({'embeddings' if task == 'embed' else 'scores'}), "
            "it cannot generate text: start it with runner='pooling' (--runner pooling)."
        )
    if config.pooler_config is not None and runner != "pooling":
        raise ValueError("pooler_config applies to runner='pooling' only.")
    if task == "score":
        num_labels(model_config.hf)  # a classifier made from LM head rows (hf_overrides) is checked before any rank
    return runner


def served_pooling_task(architecture: str) -> str:
    """What a pooling engine of this architecture answers: "score" (cross-encoders) or "embed"."""
    return "score" if pooling_task(architecture) == "score" else "embed"


def pooling_settings(config: EngineConfig, model_config: ModelConfig, max_model_len: int) -> dict[str, Any]:
    """The resolved-config fields a pooling engine runs with (see the module docstring)."""
    max_len = min(max_model_len, pooling_max_len(model_config.architecture, model_config.hf, max_model_len))
    budget = config.max_num_batched_tokens or max(max_len, _DEFAULT_POOLING_BUDGET)
    if budget < max_len:
        raise ValueError(
            f"runner='pooling' runs each prompt in one step: max_num_batched_tokens ({budget}) must be at least "
            f"max_model_len ({max_len})."
        )
    return {
        "max_model_len": max_len,
        "max_num_batched_tokens": budget,
        "enable_chunked_prefill": False,
        "enable_prefix_caching": False,
    }


def pooling_num_blocks(num_device_blocks: int, budget: int, max_num_seqs: int, block_size: int) -> int:
    """A pooling engine's KV pool: one step's prompts (each row may end in a partial block), plus the
    block manager's 1% watermark, at most what the ranks can hold."""
    one_step = -(-budget // block_size) + min(max_num_seqs, budget)
    return min(num_device_blocks, one_step + one_step // 99 + 1)


def check_pooling_request(
    token_ids: list[int], params: PoolingParams, limits: RequestLimits, task: str, hidden_size: int
) -> None:
    """RequestError (PromptTooLongError for length) unless a pooling engine serving `task` can run it."""
    if params.task != task:
        served = "embeddings" if task == "embed" else "scores (a cross-encoder)"
        raise RequestError(f"this model serves {served}: it cannot serve task {params.task!r}.", "task")
    if not token_ids:
        raise RequestError("input must not be empty.", "input")
    if min(token_ids) < 0 or max(token_ids) >= limits.vocab_size:
        raise RequestError(f"input token ids must be in [0, {limits.vocab_size}) (the vocabulary size).", "input")
    if len(token_ids) > limits.max_model_len:
        raise PromptTooLongError(
            f"This model's maximum input length is {limits.max_model_len} tokens. However, your input is "
            f"{len(token_ids)} tokens long. Set truncate_prompt_tokens (-1: the model's length) to keep its last "
            "tokens instead.",
            "input",
        )
    if params.dimensions is not None and params.dimensions > hidden_size:
        raise RequestError(
            f"dimensions ({params.dimensions}) must be at most the model's embedding size ({hidden_size}).",
            "dimensions",
        )


def pair_token_ids(tokenizer: Any, first: str, second: str, keep: int | None = None) -> list[int]:
    """A cross-encoder's input: the tokenizer's own pair encoding ([CLS] a [SEP] b [SEP] for BERT, <s> a
    </s></s> b </s> for XLM-R), as CrossEncoder.predict builds it. `keep` (truncation_length): at most that
    many tokens, cut as vLLM's tokenizer cuts a pair (longest first, from the left)."""
    if keep is None:
        return list(tokenizer(first, second)["input_ids"])
    return _checked(list(tokenizer(first, second, truncation=True, max_length=keep)["input_ids"]), keep)


# --- truncate_prompt_tokens (vLLM's) -------------------------------------------------------------------------
# Decision: vLLM's semantics. Token-id inputs keep their last `keep` ids; text inputs are cut by the tokenizer,
# which `load_tokenizer` builds with truncation_side="left" (as vLLM's get_tokenizer does): the special tokens
# ([CLS] ... [SEP]) stay and the text's first tokens go, so a CLS-pooling encoder still reads its [CLS].


def truncation_length(keep: int | None, max_model_len: int) -> int | None:
    """How many tokens each input keeps (None: no truncation); -1 is the model's length. RequestError when
    more than the model takes."""
    if keep is None:
        return None
    if keep == -1:
        return max_model_len
    if keep > max_model_len:
        raise RequestError(
            f"truncate_prompt_tokens ({keep}) is greater than this model's maximum input length "
            f"({max_model_len}): use -1 for the model's length, or a smaller value.",
            "truncate_prompt_tokens",
        )
    return keep


def truncate_ids(token_ids: list[int], keep: int | None) -> list[int]:
    """A token-id input's last `keep` ids (all of them when `keep` is None or not shorter)."""
    return token_ids if keep is None or len(token_ids) <= keep else token_ids[-keep:]


def encode_truncated(tokenizer: Any, text: str, keep: int, add_special_tokens: bool = True) -> list[int]:
    """A text input cut to `keep` tokens by the tokenizer (from the left, its special tokens kept)."""
    encoded = tokenizer(text, add_special_tokens=add_special_tokens, truncation=True, max_length=keep)
    return _checked(list(encoded["input_ids"]), keep)


def _checked(token_ids: list[int], keep: int) -> list[int]:
    # The tokenizer returns the input whole when `keep` cannot even hold its special tokens.
    if len(token_ids) > keep:
        raise RequestError(
            f"truncate_prompt_tokens ({keep}) leaves no room for the text besides the tokenizer's special tokens.",
            "truncate_prompt_tokens",
        )
    return token_ids
