"""POST /v1/completions: prompts -> engine requests -> one response or an SSE stream.

Each prompt (a string, token ids, or a list of either; at most `MAX_PROMPTS`) becomes one engine
request; its `n` samples are choices `prompt_index * n + sample_index`, as OpenAI numbers them.
`create` returns the response model (non-streaming: the HTTP route and batch jobs serialise it the
same way) or an async iterator of SSE events.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from cluster.outputs import PositionLogprobs, RequestOutput
from raytp.openai.context import DONE, ServingContext, sse
from raytp.openai.contract import check_refused
from raytp.openai.errors import bad_request, to_openai_error
from raytp.openai.logprobs import completion_logprobs
from raytp.openai.models import ModelsHandler
from raytp.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
    stream_dump,
)
from raytp.openai.requests import requested_max_tokens, resolve_max_tokens, to_sampling_params, truncate_prompt
from raytp.openai.stream import RequestStream, merge, start_all


class CompletionHandler(ModelsHandler):
    async def _prompts(self, ctx: ServingContext, req: CompletionRequest) -> list[tuple[str | None, list[int]]]:
        """(text if given as text and kept whole, token ids) per prompt, truncated as the request asks."""
        out: list[tuple[str | None, list[int]]] = []
        for text, ids in await tokenized_prompts(ctx, req.prompt, req.add_special_tokens):
            kept = truncate_prompt(ids, req.truncate_prompt_tokens, ctx.max_model_len)
            out.append((text if len(kept) == len(ids) else None, kept))  # echo decodes what was kept
        return out

    async def create(self, req: CompletionRequest, request_id: str) -> CompletionResponse | AsyncIterator[str]:
        ctx = self.models.resolve(req.model)
        check_refused(req)
        prompts = await self._prompts(ctx, req)
        requested, max_param = requested_max_tokens(req)
        streams: list[RequestStream] = []
        for i, (_, ids) in enumerate(prompts):
            params = to_sampling_params(
                req,
                max_tokens=resolve_max_tokens(
                    requested, len(ids), ctx.max_model_len, max_param, ctx.generation_defaults.get("max_tokens")
                ),
                logprobs=req.logprobs,
                prompt_logprobs=req.logprobs if req.echo and req.logprobs is not None else None,
                defaults=ctx.generation_defaults,
            )
            streams.append(ctx.stream(f"{request_id}-{i}", ids, params))
        texts = [t if t is not None else await ctx.decode(ids) for t, ids in prompts] if req.echo else []
        await start_all(streams)
        if req.stream:
            return self._stream(ctx, req, request_id, streams, texts)
        try:
            outputs = await asyncio.gather(*(s.collect() for s in streams))
        finally:
            await asyncio.gather(*(s.close() for s in streams), return_exceptions=True)
        return self._response(ctx, req, request_id, outputs, texts)

    def _response(
        self,
        ctx: ServingContext,
        req: CompletionRequest,
        request_id: str,
        outputs: list[RequestOutput],
        texts: list[str],
    ) -> CompletionResponse:
        choices: list[CompletionChoice] = []
        prompt_tokens = completion_tokens = 0
        for pi, out in enumerate(outputs):
            prompt_tokens += len(out.prompt_token_ids)
            for j, c in enumerate(out.outputs):
                completion_tokens += len(c.token_ids)
                text, logprobs = c.text, None
                if req.logprobs is not None:
                    ids = list(c.token_ids)
                    entries: list[PositionLogprobs | None] = list(c.logprobs or [])
                    if req.echo:
                        ids = out.prompt_token_ids + ids
                        entries = _prompt_entries(out.prompt_token_ids, out.prompt_logprobs) + entries
                    logprobs = completion_logprobs(ids, entries, req.logprobs, 0, ctx.decode_token)
                if req.echo:
                    text = texts[pi] + text
                choices.append(
                    CompletionChoice(
                        index=pi * req.n + j,
                        text=text,
                        logprobs=logprobs,
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                    )
                )
        usage = UsageInfo.of(prompt_tokens, completion_tokens)
        return CompletionResponse(id=request_id, model=ctx.model_name, choices=choices, usage=usage)

    async def _stream(
        self,
        ctx: ServingContext,
        req: CompletionRequest,
        request_id: str,
        streams: list[RequestStream],
        texts: list[str],
    ) -> AsyncIterator[str]:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        created = int(time.time())
        offsets: dict[tuple[int, int], int] = {}  # (prompt, sample) -> text_offset of its next token

        def chunk(
            index: int,
            text: str,
            logprobs: CompletionLogprobs | None = None,
            finish: str | None = None,
            stop: int | str | None = None,
        ) -> str:
            choice = CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=finish, stop_reason=stop)
            resp = CompletionResponse(id=request_id, created=created, model=ctx.model_name, choices=[choice])
            return sse(stream_dump(resp, include_usage))

        try:
            for pi, s in enumerate(streams):
                for j in range(req.n):
                    offsets[(pi, j)] = 0
                    if req.echo:
                        lp = None
                        if req.logprobs is not None:
                            prompt_lps = s.prompt.logprobs if s.prompt is not None else None
                            entries = _prompt_entries(s.prompt_token_ids, prompt_lps)
                            lp = completion_logprobs(s.prompt_token_ids, entries, req.logprobs, 0, ctx.decode_token)
                        offsets[(pi, j)] = len(texts[pi])
                        yield chunk(pi * req.n + j, texts[pi], lp)
            completion_tokens = 0
            async for pi, delta in merge(streams):
                for u in delta.samples:
                    completion_tokens += len(u.token_ids)
                    lp = None
                    if req.logprobs is not None and u.logprobs:
                        off = offsets[(pi, u.index)]
                        lp = completion_logprobs(u.token_ids, u.logprobs, req.logprobs, off, ctx.decode_token)
                        offsets[(pi, u.index)] = off + sum(len(t) for t in lp.tokens)
                    # One chunk per step that gave the sample tokens, its text empty while held back (an
                    # incomplete UTF-8 sequence, a possible stop string), as vLLM's server streams: a client
                    # timing its first token (`vllm bench serve`) sees it when it is sampled.
                    if u.text or u.token_ids or u.finish_reason is not None or lp is not None:
                        yield chunk(pi * req.n + u.index, u.text, lp, u.finish_reason, u.stop_reason)
            if include_usage:
                usage = UsageInfo.of(sum(len(s.prompt_token_ids) for s in streams), completion_tokens)
                resp = CompletionResponse(id=request_id, created=created, model=ctx.model_name, choices=[], usage=usage)
                yield sse(resp.model_dump())
        except Exception as e:  # headers are gone: report in-band, as OpenAI and vLLM do
            yield sse(to_openai_error(e, request_id).body())
        finally:
            await asyncio.gather(*(s.close() for s in streams), return_exceptions=True)
        yield DONE


def _prompt_entries(
    prompt_ids: list[int], entries: list[PositionLogprobs | None] | None
) -> list[PositionLogprobs | None]:
    """Prompt logprob entries aligned to the prompt tokens (the first token has none)."""
    got = list(entries or [])
    return [None] * (len(prompt_ids) - len(got)) + got


async def tokenized_prompts(
    ctx: ServingContext,
    prompt: str | list[str] | list[int] | list[list[int]],
    add_special_tokens: bool,
    param: str = "prompt",
    keep: int | None = None,
) -> list[tuple[str | None, list[int]]]:
    """(text if given as text, token ids) per prompt; `param` names the field in errors (embeddings: input).
    `keep`: texts are tokenized to at most that many tokens (ServingContext.encode); token ids are as given."""
    if isinstance(prompt, str):
        return [(prompt, await ctx.encode(prompt, add_special_tokens, param, keep))]
    if not prompt:
        raise bad_request(f"{param} must not be empty.", param)
    if all(isinstance(p, int) for p in prompt):
        return [(None, [p for p in prompt if isinstance(p, int)])]
    out: list[tuple[str | None, list[int]]] = []
    for p in prompt:
        if isinstance(p, str):
            out.append((p, await ctx.encode(p, add_special_tokens, param, keep)))
        else:
            assert isinstance(p, list)
            out.append((None, list(p)))
    return out
