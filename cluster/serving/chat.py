"""POST /v1/chat/completions: messages through the chat template -> one engine request.

Streaming follows OpenAI's chunk sequence per choice: a first delta carrying the role,
content deltas, and the finish_reason; then (if asked) a usage chunk with no choices.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.responses import Response

from cluster.serving.context import DONE, SSE_HEADERS, ServingContext, sse
from cluster.serving.errors import bad_request, to_openai_error
from cluster.serving.generation import Generation, run_to_end
from cluster.serving.logprobs import chat_logprobs
from cluster.serving.protocol import (
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
from cluster.serving.sampling import check_prompt_ids, resolve_max_tokens, to_sampling_params
from scheduler.outputs import TokenLogprobs


class ChatHandler:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def create(self, req: ChatCompletionRequest) -> Response:
        ctx = self.ctx
        ctx.check_model(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true.", "top_logprobs")
        ids = ctx.chat_prompt_ids(req.messages, req.add_generation_prompt)
        check_prompt_ids(ids, ctx.vocab_size, ctx.max_model_len, "messages")
        max_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = to_sampling_params(
            req,
            max_tokens=resolve_max_tokens(requested, len(ids), ctx.max_model_len, max_param),
            vocab_size=ctx.vocab_size,
            max_num_seqs=ctx.max_num_seqs,
            logprobs=(req.top_logprobs or 0) if req.logprobs else None,
        )
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        gen = ctx.generation(request_id, ids, params)
        await gen.start()
        if req.stream:
            return StreamingResponse(
                self._stream(req, request_id, gen), media_type="text/event-stream", headers=SSE_HEADERS
            )
        try:
            await run_to_end(gen)
        finally:
            gen.close()
        return JSONResponse(self._response(req, request_id, gen).model_dump())

    def _logprobs(
        self, req: ChatCompletionRequest, token_ids: list[int], entries: list[TokenLogprobs]
    ) -> ChatLogprobs | None:
        if not req.logprobs:
            return None
        return chat_logprobs(token_ids, entries, req.top_logprobs or 0, self.ctx.decode_token)

    def _response(self, req: ChatCompletionRequest, request_id: str, gen: Generation) -> ChatCompletionResponse:
        seqs = gen.best(req.n)
        choices = [
            ChatChoice(
                index=i,
                message=ChatMessageOut(content=seq.text),
                logprobs=self._logprobs(req, seq.token_ids, seq.logprobs),
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
            )
            for i, seq in enumerate(seqs)
        ]
        usage = UsageInfo.of(len(gen.prompt_token_ids), sum(len(s.token_ids) for s in seqs))
        return ChatCompletionResponse(id=request_id, model=self.ctx.model_name, choices=choices, usage=usage)

    async def _stream(self, req: ChatCompletionRequest, request_id: str, gen: Generation) -> AsyncIterator[str]:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        created = int(time.time())

        def chunk(choice: ChatStreamChoice) -> str:
            resp = ChatCompletionChunk(id=request_id, created=created, model=self.ctx.model_name, choices=[choice])
            return sse(stream_dump(resp, include_usage))

        try:
            for i in range(req.n):
                yield chunk(ChatStreamChoice(index=i, delta={"role": "assistant", "content": ""}))
            completion_tokens = 0
            async for updates in gen.updates():
                for u in updates:
                    completion_tokens += len(u.token_ids)
                    lp = self._logprobs(req, u.token_ids, u.logprobs) if u.logprobs else None
                    if u.text or lp is not None or u.finish_reason is not None:
                        delta = {"content": u.text} if u.text or lp is not None else {}
                        yield chunk(
                            ChatStreamChoice(
                                index=u.index,
                                delta=delta,
                                logprobs=lp,
                                finish_reason=u.finish_reason,
                                stop_reason=u.stop_reason,
                            )
                        )
            if include_usage:
                usage = UsageInfo.of(len(gen.prompt_token_ids), completion_tokens)
                resp = ChatCompletionChunk(
                    id=request_id, created=created, model=self.ctx.model_name, choices=[], usage=usage
                )
                yield sse(resp.model_dump())
        except Exception as e:  # headers are gone: report in-band, as OpenAI and vLLM do
            yield sse(to_openai_error(e).body())
        finally:
            gen.close()
        yield DONE
