"""POST /v1/chat/completions: messages through the chat template -> one engine request.

Streaming follows OpenAI's chunk sequence per choice: a first delta carrying the role,
content deltas, and the finish_reason; then (if asked) a usage chunk with no choices.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from cluster.outputs import PositionLogprobs
from raytp.openai.context import DONE, ServingContext, sse
from raytp.openai.contract import check_refused
from raytp.openai.errors import bad_request, to_openai_error, unwrap
from raytp.openai.logprobs import chat_logprobs
from raytp.openai.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessageOut,
    ChatStreamChoice,
    UsageInfo,
    stream_dump,
)
from raytp.openai.requests import requested_max_tokens, resolve_max_tokens, to_sampling_params, truncate_prompt
from raytp.openai.stream import RequestStream
from scheduler.errors import RequestError


class ChatHandler:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def create(self, req: ChatCompletionRequest, request_id: str) -> ChatCompletionResponse | AsyncIterator[str]:
        ctx = self.ctx
        ctx.check_model(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true.", "top_logprobs")
        check_refused(req)
        ids = await ctx.chat_prompt_ids(req.messages, req.add_generation_prompt)
        ids = truncate_prompt(ids, req.truncate_prompt_tokens, ctx.max_model_len)
        requested, max_param = requested_max_tokens(req)
        params = to_sampling_params(
            req,
            max_tokens=resolve_max_tokens(requested, len(ids), ctx.max_model_len, max_param),
            logprobs=(req.top_logprobs or 0) if req.logprobs else None,
        )
        stream = ctx.stream(request_id, ids, params)
        try:
            await stream.start()
        except Exception as e:
            cause = unwrap(e)
            if isinstance(cause, RequestError) and cause.param == "prompt":  # a chat request's prompt: its messages
                raise RequestError(cause.message, "messages", cause.code) from None
            raise
        if req.stream:
            return self._stream(req, request_id, stream)
        out = await stream.collect()
        choices = [
            ChatChoice(
                index=c.index,
                message=ChatMessageOut(content=c.text),
                logprobs=self._logprobs(req, c.token_ids, c.logprobs),
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
            for c in out.outputs
        ]
        usage = UsageInfo.of(len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs))
        return ChatCompletionResponse(id=request_id, model=ctx.model_name, choices=choices, usage=usage)

    def _logprobs(
        self, req: ChatCompletionRequest, token_ids: list[int], entries: list[PositionLogprobs] | None
    ) -> ChatLogprobs | None:
        if not req.logprobs or entries is None:
            return None
        return chat_logprobs(token_ids, entries, req.top_logprobs or 0)

    async def _stream(self, req: ChatCompletionRequest, request_id: str, stream: RequestStream) -> AsyncIterator[str]:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        created = int(time.time())

        def chunk(choice: ChatStreamChoice) -> str:
            resp = ChatCompletionChunk(id=request_id, created=created, model=self.ctx.model_name, choices=[choice])
            return sse(stream_dump(resp, include_usage))

        try:
            for i in range(req.n):
                yield chunk(ChatStreamChoice(index=i, delta={"role": "assistant", "content": ""}))
            completion_tokens = 0
            async for delta in stream.deltas():
                for u in delta.samples:
                    completion_tokens += len(u.token_ids)
                    lp = self._logprobs(req, u.token_ids, u.logprobs) if u.logprobs else None
                    if u.text or lp is not None or u.finish_reason is not None:
                        content = {"content": u.text} if u.text or lp is not None else {}
                        yield chunk(
                            ChatStreamChoice(
                                index=u.index,
                                delta=content,
                                logprobs=lp,
                                finish_reason=u.finish_reason,
                                stop_reason=u.stop_reason,
                            )
                        )
            if include_usage:
                usage = UsageInfo.of(len(stream.prompt_token_ids), completion_tokens)
                resp = ChatCompletionChunk(
                    id=request_id, created=created, model=self.ctx.model_name, choices=[], usage=usage
                )
                yield sse(resp.model_dump())
        except Exception as e:  # headers are gone: report in-band, as OpenAI and vLLM do
            yield sse(to_openai_error(e, request_id).body())
        finally:
            await stream.close()
        yield DONE
