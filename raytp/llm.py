"""The offline API, shaped like vLLM's `LLM` so users can switch without relearning."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, cast

from tqdm.auto import tqdm

from cluster.config import EngineConfig
from cluster.engine import LLMEngine, PromptType
from cluster.outputs import RequestOutput, RequestOutputBuilder
from cluster.pooling_outputs import EmbeddingRequestOutput, ScoringRequestOutput
from raytp import pooling
from raytp.chat_template import render_chat
from request.lora import LoRARequest
from request.pooling_params import PoolingParams
from request.sampling_params import SamplingParams

LoRAArg = LoRARequest | Sequence[LoRARequest | None] | None  # one adapter for every prompt, or one per prompt


class LLM:
    """Generate text for a batch of prompts with continuous batching and a paged KV cache.

    `model=None` loads the embedded SmolLM2-135M-Instruct. Keyword arguments are
    vLLM's engine arguments (see `EngineConfig`).
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        unknown = set(kwargs) - {f.name for f in EngineConfig.__dataclass_fields__.values()}
        if unknown:
            raise TypeError(f"LLM() got unexpected keyword arguments: {', '.join(sorted(unknown))}")
        self.llm_engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self._counter = itertools.count()

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter now (generate loads one on first use); False when it is already loaded."""
        return self.llm_engine.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Unload an adapter; False when it is not loaded. Refused while a request uses it."""
        return self.llm_engine.remove_lora(lora_int_id)

    def list_loras(self) -> list[LoRARequest]:
        return self.llm_engine.list_loras()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What a call without sampling_params samples with: SamplingParams' defaults, with the fields the
        model's generation_config.json sets taken from it (vLLM's `--generation-config auto`; the engine
        argument `generation_config="vllm"` leaves SamplingParams' own)."""
        return SamplingParams(**self.llm_engine.generation_defaults)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRAArg = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order.

        `lora_request`: a `LoRARequest` for every prompt, or a list with one per prompt (None: the base model);
        an adapter not loaded yet is loaded first (engine argument `enable_lora=True`)."""
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(
                    f"sampling_params must be one SamplingParams or one per prompt: got {len(params_list)} "
                    f"for {len(prompt_list)} prompts."
                )
        return self._run(prompt_list, params_list, _per_prompt_loras(lora_request, len(prompt_list)), use_tqdm)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRAArg = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, through the tokenizer's chat template,
        rendered as the HTTP server renders it (raytp/chat_template.py: the same conversation, the same prompt).

        `tools` (OpenAI function tools) and `chat_template_kwargs` (e.g. `enable_thinking`) reach the template,
        as in vLLM; to force a tool call's arguments, give `SamplingParams(structured_outputs=...)` its schema.
        `lora_request` as in `generate`: one adapter for every conversation, or one per conversation.
        """
        one = bool(messages) and isinstance(messages[0], dict)
        conversations = cast("list[list[dict[str, Any]]]", [messages] if one else messages)
        tokenizer = self.get_tokenizer()
        prompts: list[PromptType] = []
        for conv in conversations:
            ids = render_chat(tokenizer, conv, add_generation_prompt, tools, chat_template_kwargs, chat_template)
            prompts.append({"prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = True,
        *,
        truncate_prompt_tokens: int | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (`.outputs.embedding`), in input order; a pooling model (runner="pooling").
        `pooling_params`: e.g. `PoolingParams(dimensions=64)` (Matryoshka) or `normalize=False`.
        `truncate_prompt_tokens` (vLLM's; or the PoolingParams field): keep each input's last that many
        tokens (-1: the model's length); unset, an input over the model's length is refused."""
        params = pooling.with_truncation(pooling_params or PoolingParams(task="embed"), truncate_prompt_tokens)
        return pooling.embed(self.llm_engine, _as_prompt_list(prompts), params, self._counter, use_tqdm)

    def score(
        self,
        text_1: str | Sequence[str],
        text_2: str | Sequence[str],
        use_tqdm: bool = True,
        *,
        truncate_prompt_tokens: int | None = None,
    ) -> list[ScoringRequestOutput]:
        """Relevance of each (text_1, text_2) pair (`.outputs.score`): one text_1 against every text_2, or two
        lists zipped. A cross-encoder scores each pair; an embedding model the cosine of the embeddings.
        `truncate_prompt_tokens`: as `embed`, per pair for a cross-encoder, per text for an embedding model."""
        return pooling.score(self.llm_engine, text_1, text_2, self._counter, use_tqdm, truncate_prompt_tokens)

    def _run(
        self,
        prompts: list[PromptType],
        params: list[SamplingParams],
        loras: list[LoRARequest | None],
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        engine = self.llm_engine
        ids: list[str] = []
        try:
            for prompt, p, lora in zip(prompts, params, loras, strict=True):
                rid = str(next(self._counter))
                engine.add_request(rid, prompt, p, lora_request=lora)
                ids.append(rid)
        except Exception:
            # A bad prompt refuses the whole call. Aborting frees this call's blocks at once; requests
            # that others added to the engine are left running.
            engine.abort_request(ids)
            raise
        # The engine's one output stream: deltas, folded here into whole outputs.
        builders = {rid: RequestOutputBuilder(rid) for rid in ids}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm)
        while engine.has_unfinished_requests():
            for delta in engine.step():
                builder = builders.get(delta.request_id)
                if builder is not None:
                    builder.add(delta)
                    bar.update(int(delta.finished))
        bar.close()
        return [builders[rid].build() for rid in ids]


def _per_prompt_loras(lora_request: LoRAArg, num_prompts: int) -> list[LoRARequest | None]:
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts
    loras = list(lora_request)
    if len(loras) != num_prompts:
        raise ValueError(
            f"lora_request must be one LoRARequest or one per prompt: got {len(loras)} for {num_prompts} prompts."
        )
    return loras


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, str | dict):
        return [prompts]
    if isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return list(prompts)  # type: ignore[arg-type]
