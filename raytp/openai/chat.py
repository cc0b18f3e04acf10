"""POST /v1/chat/completions: messages through the chat template -> one engine request.

Streaming follows OpenAI's chunk sequence per choice: a first delta carrying the role,
content deltas, and the finish_reason; then (if asked) a usage chunk with no choices.

Tools and reasoning (`tools.py`, `chat_output.py`): each sample's text goes through a `SampleParser`,
which splits out `reasoning_content` and tool calls; the non-streamed message is that parser's deltas
for the whole text, folded, so both roads give the same message. A sample that called tools and
stopped by itself finishes with `tool_calls`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

from cluster.outputs import PositionLogprobs
from raytp.openai.chat_output import SampleParser, fold
from raytp.openai.chat_settings import ChatSettings
from raytp.openai.context import DONE, ServingContext, sse
from raytp.openai.contract import check_refused
from raytp.openai.errors import bad_request, to_openai_error, unwrap
from raytp.openai.logprobs import chat_logprobs
from raytp.openai.models import ModelsHandler, ServedModels
from raytp.openai.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessageOut,
    ChatStreamChoice,
    ToolCallOut,
    UsageInfo,
    stream_dump,
)
from raytp.openai.requests import requested_max_tokens, resolve_max_tokens, to_sampling_params, truncate_prompt
from raytp.openai.stream import RequestStream
from raytp.openai.tools import ToolPlan, plan_tools
from request.errors import RequestError
from request.sampling_params import SamplingParams

_REASONING_TAIL_TOKENS = 32


class ChatHandler(ModelsHandler):
    def __init__(self, models: ServedModels | ServingContext, settings: ChatSettings | None = None) -> None:
        super().__init__(models)
        self._settings = settings  # None: each model's own (ctx.chat)

    def settings(self, ctx: ServingContext) -> ChatSettings:
        return self._settings if self._settings is not None else ctx.chat

    async def create(self, req: ChatCompletionRequest, request_id: str) -> ChatCompletionResponse | AsyncIterator[str]:
        ctx = self.models.resolve(req.model)
        settings = self.settings(ctx)
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true.", "top_logprobs")
        check_refused(req)
        plan = plan_tools(req, settings)
        ids = await ctx.chat_prompt_ids(
            req.messages, req.add_generation_prompt, plan.template_tools, req.chat_template_kwargs
        )
        ids = truncate_prompt(ids, req.truncate_prompt_tokens, ctx.max_model_len)
        requested, max_param = requested_max_tokens(req)
        params = to_sampling_params(
            req,
            max_tokens=resolve_max_tokens(
                requested, len(ids), ctx.max_model_len, max_param, ctx.generation_defaults.get("max_tokens")
            ),
            logprobs=(req.top_logprobs or 0) if req.logprobs else None,
            defaults=ctx.generation_defaults,
        )
        stream = ctx.stream(request_id, ids, _after_reasoning(ctx, settings, _with_tools(params, plan), ids))
        try:
            await stream.start()
        except Exception as e:
            cause = unwrap(e)
            if isinstance(cause, RequestError) and cause.param == "prompt":  # a chat request's prompt: its messages
                raise RequestError(cause.message, "messages", cause.code) from None
            raise
        if req.stream:
            return self._stream(ctx, settings, req, request_id, stream, plan)
        out = await stream.collect()
        choices = []
        for c in out.outputs:
            parser = _parser(settings, plan)
            msg = fold(parser.feed(c.text, final=True))
            message = ChatMessageOut(
                content=msg.content,
                reasoning_content=msg.reasoning_content,
                tool_calls=[ToolCallOut.model_validate(call) for call in msg.tool_calls],
            )
            choices.append(
                ChatChoice(
                    index=c.index,
                    message=message,
                    logprobs=self._logprobs(req, c.token_ids, c.logprobs),
                    finish_reason=parser.finish_reason(c.finish_reason),
                    stop_reason=c.stop_reason,
                )
            )
        usage = UsageInfo.of(len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs))
        return ChatCompletionResponse(id=request_id, model=ctx.model_name, choices=choices, usage=usage)

    def _logprobs(
        self, req: ChatCompletionRequest, token_ids: list[int], entries: list[PositionLogprobs] | None
    ) -> ChatLogprobs | None:
        if not req.logprobs or entries is None:
            return None
        return chat_logprobs(token_ids, entries, req.top_logprobs or 0)

    async def _stream(
        self,
        ctx: ServingContext,
        settings: ChatSettings,
        req: ChatCompletionRequest,
        request_id: str,
        stream: RequestStream,
        plan: ToolPlan,
    ) -> AsyncIterator[str]:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        created = int(time.time())

        def chunk(choice: ChatStreamChoice) -> str:
            resp = ChatCompletionChunk(id=request_id, created=created, model=ctx.model_name, choices=[choice])
            return sse(stream_dump(resp, include_usage))

        try:
            parsers = [_parser(settings, plan) for _ in range(req.n)]
            for i in range(req.n):
                yield chunk(ChatStreamChoice(index=i, delta={"role": "assistant", "content": ""}))
            completion_tokens = 0
            async for delta in stream.deltas():
                for u in delta.samples:
                    completion_tokens += len(u.token_ids)
                    lp = self._logprobs(req, u.token_ids, u.logprobs) if u.logprobs else None
                    parser = parsers[u.index]
                    deltas: list[dict[str, Any]] = parser.feed(u.text, final=u.finish_reason is not None)
                    if not deltas and (lp is not None or u.finish_reason is not None):
                        # logprobs of text held back (a possible tag) still go out with their tokens
                        deltas = [{"content": ""} if lp is not None else {}]
                    elif not deltas and u.token_ids and parser.plain:
                        # a token whose text is held back (incomplete UTF-8, a possible stop string) is still
                        # a chunk of empty content, as vLLM streams it; behind a parser nothing goes out
                        deltas = [{"content": ""}]
                    for k, d in enumerate(deltas):
                        last = k == len(deltas) - 1
                        yield chunk(
                            ChatStreamChoice(
                                index=u.index,
                                delta=d,
                                logprobs=lp if k == 0 else None,
                                finish_reason=parser.finish_reason(u.finish_reason) if last else None,
                                stop_reason=u.stop_reason if last else None,
                            )
                        )
            if include_usage:
                usage = UsageInfo.of(len(stream.prompt_token_ids), completion_tokens)
                resp = ChatCompletionChunk(
                    id=request_id, created=created, model=ctx.model_name, choices=[], usage=usage
                )
                yield sse(resp.model_dump())
        except Exception as e:  # headers are gone: report in-band, as OpenAI and vLLM do
            yield sse(to_openai_error(e, request_id).body())
        finally:
            await stream.close()
        yield DONE


def _with_tools(params: SamplingParams, plan: ToolPlan) -> SamplingParams:
    if plan.constraint is not None:
        if params.structured_outputs is not None:
            raise RequestError(
                f"{plan.constraint.field} constrains the output to tool calls; it cannot be combined with "
                "response_format or structured_outputs.",
                plan.constraint.field,
            )
        params = dataclasses.replace(params, structured_outputs=plan.constraint)
    if plan.parser is not None and plan.parser.needs_special_tokens:  # the markup is special tokens (as vLLM)
        params = dataclasses.replace(params, skip_special_tokens=False)
    return params


def _after_reasoning(
    ctx: ServingContext, settings: ChatSettings, params: SamplingParams, prompt_ids: list[int]
) -> SamplingParams:
    """With a reasoning parser, a constraint applies to the answer, after the reasoning ends (as in vLLM),
    unless the prompt already ended it (Qwen3's template with enable_thinking=false closes the section)."""
    reasoning = settings.reasoning()
    spec = params.structured_outputs
    if reasoning is None or spec is None:
        return params
    # The template's own markers sit at the prompt's end; a few dozen tokens hold them.
    tail = ctx.tokenizer.decode(prompt_ids[-_REASONING_TAIL_TOKENS:], skip_special_tokens=False)
    if tail.rfind(reasoning.end) > tail.rfind(reasoning.start) >= 0 or (
        reasoning.end in tail and reasoning.start not in tail
    ):
        return params
    return dataclasses.replace(params, structured_outputs=dataclasses.replace(spec, start_after=reasoning.end))


def _parser(settings: ChatSettings, plan: ToolPlan) -> SampleParser:
    return SampleParser(settings.reasoning(), plan.parser, plan.max_calls)
