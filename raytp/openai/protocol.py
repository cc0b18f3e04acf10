"""OpenAI request and response schemas (pydantic lives at the HTTP boundary only).

Field names, defaults and response shapes follow OpenAI's API; the vLLM extensions
(`top_k`, `min_p`, `repetition_penalty`, `stop_token_ids`, `ignore_eos`, `min_tokens`, ...)
are accepted under the same names vLLM uses. Every declared field is either honoured or refused
with a 400 naming it (`contract.py` holds the refusals; docs/openai_contract.md the table).
Unknown request fields are ignored, as vLLM does, so clients that send newer OpenAI fields keep
working (logged once per name: base.py); `null` means "the default" for every optional field.

The request schemas state types and widths (every number finite, integers within the engine's
int64/int32 tensors); value ranges (temperature >= 0, top_p in (0, 1], ...) are checked once, by
`SamplingParams`, for the HTTP service and the offline API alike. The same models parse batch-job
bodies, so a batch line accepts exactly what the HTTP server accepts.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Generic, Literal, TypeVar

from pydantic import BaseModel, Field, field_validator

from raytp.openai.base import OpenAIModel, OpenAIRequest
from raytp.openai.structured import ResponseFormat, StructuredOutputsIn

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
INT32_MAX = (1 << 31) - 1
MAX_PROMPTS = 256  # prompts in one /v1/completions request (each is one engine request)

TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
Count = Annotated[int, Field(ge=0, le=INT32_MAX)]
Seed = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]

# ----------------------------------------------------------------------------- requests


class StreamOptions(OpenAIRequest):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # OpenAI's padding of stream chunks: raytp never pads (harmless)
    continuous_usage_stats: bool = False  # vLLM: usage in every chunk (refused: contract.py)


class SamplingFields(OpenAIRequest):
    """Fields shared by /v1/completions and /v1/chat/completions. Each is honoured (mapped in
    requests.py or used by the handlers), accepted as metadata, or refused (contract.py)."""

    model: str | None = None  # None: the served model (vLLM accepts the omission too)
    n: Count = 1
    best_of: Count | None = None
    temperature: float | None = None  # None: 1.0, OpenAI's default
    top_p: float | None = None
    seed: Seed | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None  # token id (as a JSON key string) -> bias
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Constrained output: at most one of these sources per request (requests.structured_outputs).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsIn | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # only backends raytp has: "auto", "guidance"
    guided_whitespace_pattern: str | None = None  # with guided_json / json response formats
    # Metadata: accepted, no effect on the output (raytp stores nothing and serves one tier).
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None  # only false: raytp stores no completions (contract.py)
    service_tier: str | None = None  # only "auto" / "default" (contract.py)
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None  # raytp's prefix cache needs no hint
    # vLLM extensions
    top_k: Annotated[int, Field(ge=-1, le=INT32_MAX)] | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    min_tokens: Count = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # keep the last k prompt tokens (-1: the last max_model_len)
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=INT32_MAX)] | None = None
    # vLLM extensions raytp refuses unless neutral (contract.py says why, per field)
    use_beam_search: bool = False
    length_penalty: float = 1.0
    prompt_logprobs: Count | None = None
    allowed_token_ids: list[TokenId] | None = None
    bad_words: list[str] | None = None
    priority: int = 0
    request_id: str | None = None
    logits_processors: list[Any] | None = None
    return_tokens_as_token_ids: bool = False
    return_token_ids: bool = False
    cache_salt: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None


class CompletionRequest(SamplingFields):
    # A prompt as text or token ids, or a list of either (at most MAX_PROMPTS prompts).
    prompt: (
        str
        | Annotated[list[str], Field(max_length=MAX_PROMPTS)]
        | list[TokenId]
        | Annotated[list[list[TokenId]], Field(max_length=MAX_PROMPTS)]
    )
    max_tokens: Count | None = 16  # OpenAI's default for legacy completions; null: as many as fit (vLLM)
    max_completion_tokens: Count | None = None  # vLLM accepts it here too; it wins over max_tokens
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=20)
    suffix: str | None = None  # raytp has no fill-in-the-middle: a non-empty suffix is refused
    add_special_tokens: bool = True  # vLLM: the tokenizer's BOS etc. around a text prompt
    prompt_embeds: str | list[str] | None = None  # vLLM: refused


# ----------------------------------------------------------------------------- tool calling (issue 31, items 3-4)
# What `raytp/openai/tools.py` turns into the template's `tools`, the output parser and the constraint.


class FunctionDefinition(OpenAIRequest):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments ({})
    strict: bool | None = None  # arguments exactly as the schema says (enforced by a constraint)

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        """OpenAI's rule (vLLM's too): a function's arguments are a JSON object, so its schema is of type
        "object" ({} and a schema with `properties` but no `type` mean the same). A string schema under
        tool_choice "required" would otherwise constrain the call into something no parser reads."""
        if v is None or v.get("type") == "object" or ("type" not in v and (not v or "properties" in v)):
            return v
        what = f"type {v['type']!r}" if "type" in v else "no type and no properties"
        raise ValueError(f'function parameters must be a JSON schema of type "object"; this one has {what}.')


class ChatTool(OpenAIRequest):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(OpenAIRequest):
    name: str


class NamedToolChoice(OpenAIRequest):
    type: Literal["function"] = "function"
    function: NamedFunction


class FunctionCallIn(OpenAIRequest):
    name: str
    arguments: str  # JSON text, as OpenAI returned it


class ToolCallIn(OpenAIRequest):
    """An assistant message's earlier tool call, sent back in a multi-turn conversation."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ToolFields(OpenAIRequest):
    """The chat request's tool-calling fields."""

    tools: list[ChatTool] | None = None
    # None: "auto" when tools are given, else "none" (OpenAI's default)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # None: true
    # OpenAI's deprecated predecessors of tools/tool_choice: refused with a 400 naming them, since a client
    # that sends them reads `message.function_call`, which raytp does not answer with.
    functions: list[Any] | None = None
    function_call: Any = None
    # Extra variables for the chat template (e.g. enable_thinking); each must be one the template reads.
    chat_template_kwargs: dict[str, Any] | None = None


class FunctionCallOut(OpenAIModel):
    name: str
    arguments: str  # JSON text


class ToolCallOut(OpenAIModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ContentPart(OpenAIRequest):
    type: str
    text: str | None = None


class ChatMessageIn(OpenAIRequest):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    # tool calling: an assistant's calls, and which call a `tool` message answers
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(SamplingFields, ToolFields):
    messages: list[ChatMessageIn] = Field(min_length=1)
    max_tokens: Count | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: Count | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True  # vLLM extension
    # OpenAI fields raytp refuses unless absent or neutral (contract.py)
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    web_search_options: dict[str, Any] | None = None
    # vLLM chat extensions raytp refuses unless neutral (contract.py)
    echo: bool = False
    continue_final_message: bool = False
    add_special_tokens: bool = False
    documents: list[dict[str, Any]] | None = None
    chat_template: str | None = None
    mm_processor_kwargs: dict[str, Any] | None = None


class TokenizeRequest(OpenAIRequest):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageIn] | None = None  # tokenized through the chat template
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(OpenAIRequest):
    model: str | None = None
    tokens: list[TokenId]


class LoadLoRAAdapterRequest(OpenAIRequest):
    """POST /v1/load_lora_adapter, as vLLM's (its `load_inplace` is not offered: a name is loaded once)."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    # raytp's: the model it adapts; needed only when several served models have enable_lora
    base_model_name: str | None = None


class UnloadLoRAAdapterRequest(OpenAIRequest):
    lora_name: str = Field(min_length=1)


# ----------------------------------------------------------------------------- responses


def _now() -> int:
    return int(time.time())


class UsageInfo(OpenAIModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> UsageInfo:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )


class CompletionLogprobs(OpenAIModel):
    """The legacy completions logprobs object: parallel lists, one entry per token."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


LogprobsT = TypeVar("LogprobsT", bound=OpenAIModel)


class Choice(OpenAIModel, Generic[LogprobsT]):
    """What every choice object carries beside its content (a subclass adds `text`, `message` or `delta`)."""

    index: int
    logprobs: LogprobsT | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM extension: the stop string or token id that ended it


class CompletionChoice(Choice[CompletionLogprobs]):
    text: str


ChoiceT = TypeVar("ChoiceT", bound=OpenAIModel)


class ChoicesResponse(OpenAIModel, Generic[ChoiceT]):
    """The envelope OpenAI's completion, chat completion and chat chunk objects share; each class names its
    `object` (a subclass's field keeps its place here, so the JSON order stays OpenAI's)."""

    id: str
    object: str
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChoiceT]
    usage: UsageInfo | None = None


class CompletionResponse(ChoicesResponse[CompletionChoice]):
    object: Literal["text_completion"] = "text_completion"


class TopLogprob(OpenAIModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(OpenAIModel):
    content: list[ChatTokenLogprob] | None = None


class ChatMessageOut(OpenAIModel):
    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None  # with a reasoning parser: the text before the end of reasoning
    tool_calls: list[ToolCallOut] = Field(default_factory=list)


class ChatChoice(Choice[ChatLogprobs]):
    message: ChatMessageOut


class ChatCompletionResponse(ChoicesResponse[ChatChoice]):
    object: Literal["chat.completion"] = "chat.completion"


class ChatStreamChoice(Choice[ChatLogprobs]):
    # {"role": ...} first, then {"content": ...}, {"reasoning_content": ...} or {"tool_calls": [...]}; {} at the end
    delta: dict[str, Any]


class ChatCompletionChunk(ChoicesResponse[ChatStreamChoice]):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"


class ModelCard(OpenAIModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "raytp"
    root: str | None = None  # a base model's served name; an adapter's checkpoint path (vLLM's)
    parent: str | None = None  # an adapter's base model (vLLM's); None for a base model
    max_model_len: int | None = None
    # raytp's extension: the quantization the weights run ("fp8" | "gguf" | "int8" | "none"), as the engine's ranks
    # decided it at load; an adapter's card shows its base model's (its requests run on those weights)
    quantization: str


class ModelList(OpenAIModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(OpenAIModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(OpenAIModel):
    prompt: str


def stream_dump(chunk: BaseModel, include_usage: bool) -> dict[str, Any]:
    """A chunk as OpenAI streams it: with `"usage": null` only when the client asked for usage."""
    return chunk.model_dump(exclude=None if include_usage else {"usage"})
