"""POST /v1/completions: prompts -> engine requests -> one response or an SSE stream.

Each prompt (a string, token ids, or a list of either) becomes one engine request; its
`n` samples are choices `prompt_index * n + sample_index`, as OpenAI numbers them.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.responses import Response

from cluster.serving.context import DONE, SSE_HEADERS, ServingContext, sse
from cluster.serving.errors import bad_request, to_openai_error
from cluster.serving.generation import Generation, merge_updates, run_to_end, start_all
from cluster.serving.logprobs import completion_logprobs
from cluster.serving.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
    stream_dump,
)
from cluster.serving.sampling import check_prompt_ids, resolve_max_tokens, to_sampling_params
from scheduler.outputs import TokenLogprobs


class CompletionHandler:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    def _prompts(self, prompt: str | list[str] | list[int] | list[list[int]]) -> list[tuple[str | None, list[int]]]:
        """(text if given as text, token ids) per prompt."""
        if isinstance(prompt, str):
            return [(prompt, self.ctx.encode(prompt))]
        if not prompt:
            raise bad_request("prompt must not be empty.", "prompt")
        out: list[tuple[str | None, list[int]]] = []
        if all(isinstance(p, int) for p in prompt):
            return [(None, [int(p) for p in prompt])]  # type: ignore[arg-type]
        for p in prompt:
            if isinstance(p, str):
                out.append((p, self.ctx.encode(p)))
            else:
                assert isinstance(p, list)
                out.append((None, list(p)))
        return out

    async def create(self, req: CompletionRequest) -> Response:
        ctx = self.ctx
        ctx.check_model(req.model)
        if req.stream and req.best_of is not None and req.best_of > req.n:
            raise bad_request("best_of greater than n is not supported when streaming.", "best_of")
        if req.suffix:
            raise bad_request("suffix is not supported.", "suffix")
        request_id = f"cmpl-{uuid.uuid4().hex}"
        prompts = self._prompts(req.prompt)
        gens: list[Generation] = []
        for i, (_, ids) in enumerate(prompts):
            check_prompt_ids(ids, ctx.vocab_size, ctx.max_model_len, "prompt")
            params = to_sampling_params(
                req,
                max_tokens=resolve_max_tokens(req.max_tokens, len(ids), ctx.max_model_len, "max_tokens"),
                vocab_size=ctx.vocab_size,
                max_num_seqs=ctx.max_num_seqs,
                best_of=req.best_of,
                logprobs=req.logprobs,
                prompt_logprobs=req.logprobs if req.echo and req.logprobs is not None else None,
            )
            gens.append(ctx.generation(f"{request_id}-{i}", ids, params))
        texts = [t if t is not None else ctx.tokenizer.decode(ids) for t, ids in prompts]
        await start_all(gens)
        if req.stream:
            return StreamingResponse(
                self._stream(req, request_id, gens, texts), media_type="text/event-stream", headers=SSE_HEADERS
            )
        try:
            await asyncio.gather(*(run_to_end(g) for g in gens))
        finally:
            for g in gens:
                g.close()
        return JSONResponse(self._response(req, request_id, gens, texts).model_dump())

    def _response(
        self, req: CompletionRequest, request_id: str, gens: list[Generation], texts: list[str]
    ) -> CompletionResponse:
        choices: list[CompletionChoice] = []
        prompt_tokens = completion_tokens = 0
        for pi, gen in enumerate(gens):
            prompt_tokens += len(gen.prompt_token_ids)
            for j, seq in enumerate(gen.best(req.n)):
                completion_tokens += len(seq.token_ids)
                text, logprobs = seq.text, None
                if req.logprobs is not None:
                    ids = list(seq.token_ids)
                    entries: list[TokenLogprobs | None] = list(seq.logprobs)
                    if req.echo:
                        ids = gen.prompt_token_ids + ids
                        entries = _prompt_entries(gen) + entries
                    logprobs = completion_logprobs(ids, entries, req.logprobs, self.ctx.decode_token, 0)
                if req.echo:
                    text = texts[pi] + text
                choices.append(
                    CompletionChoice(
                        index=pi * req.n + j,
                        text=text,
                        logprobs=logprobs,
                        finish_reason=seq.finish_reason,
                        stop_reason=seq.stop_reason,
                    )
                )
        usage = UsageInfo.of(prompt_tokens, completion_tokens)
        return CompletionResponse(id=request_id, model=self.ctx.model_name, choices=choices, usage=usage)

    async def _stream(
        self, req: CompletionRequest, request_id: str, gens: list[Generation], texts: list[str]
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
            resp = CompletionResponse(id=request_id, created=created, model=self.ctx.model_name, choices=[choice])
            return sse(stream_dump(resp, include_usage))

        try:
            for pi, gen in enumerate(gens):
                for j in range(req.n):
                    offsets[(pi, j)] = 0
                    if req.echo:
                        lp = None
                        if req.logprobs is not None:
                            ids = gen.prompt_token_ids
                            lp = completion_logprobs(ids, _prompt_entries(gen), req.logprobs, self.ctx.decode_token, 0)
                        offsets[(pi, j)] = len(texts[pi])
                        yield chunk(pi * req.n + j, texts[pi], lp)
            completion_tokens = 0
            async for pi, updates in merge_updates(gens):
                for u in updates:
                    completion_tokens += len(u.token_ids)
                    lp = None
                    if req.logprobs is not None and u.logprobs:
                        off = offsets[(pi, u.index)]
                        lp = completion_logprobs(u.token_ids, u.logprobs, req.logprobs, self.ctx.decode_token, off)
                        offsets[(pi, u.index)] = off + sum(len(s) for s in lp.tokens)
                    if u.text or u.finish_reason is not None or lp is not None:
                        yield chunk(pi * req.n + u.index, u.text, lp, u.finish_reason, u.stop_reason)
            if include_usage:
                usage = UsageInfo.of(sum(len(g.prompt_token_ids) for g in gens), completion_tokens)
                resp = CompletionResponse(
                    id=request_id, created=created, model=self.ctx.model_name, choices=[], usage=usage
                )
                yield sse(resp.model_dump())
        except Exception as e:  # headers are gone: report in-band, as OpenAI and vLLM do
            yield sse(to_openai_error(e).body())
        finally:
            for g in gens:
                g.close()
        yield DONE


def _prompt_entries(gen: Generation) -> list[TokenLogprobs | None]:
    """Prompt logprob entries aligned to the prompt tokens (the first token has none)."""
    entries = list(gen.prompt_logprobs or [])
    return [None] * (len(gen.prompt_token_ids) - len(entries)) + entries
