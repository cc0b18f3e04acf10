"""Token logprobs in OpenAI's two shapes: legacy completions (parallel lists) and chat (objects).

The engine reports, per position, {token id: Logprob(logprob, rank, decoded_token)} holding the
top-k plus the sampled token, already decoded. OpenAI's top lists hold the top-k only, plus the
sampled token in the completions shape (as vLLM does). -inf (a token masked out) is not JSON:
it is clamped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from cluster.outputs import Logprob, PositionLogprobs
from raytp.openai.protocol import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob

_MIN_LOGPROB = -9999.0  # what -inf becomes (vLLM's choice too)


def _lp(x: float) -> float:
    return max(x, _MIN_LOGPROB)


def _text(entry: Logprob) -> str:
    return entry.decoded_token if entry.decoded_token is not None else ""


def _top(entry: PositionLogprobs, k: int) -> list[Logprob]:
    return sorted((lp for lp in entry.values() if lp.rank <= k), key=lambda lp: lp.rank)


def completion_logprobs(
    token_ids: Sequence[int],
    entries: Sequence[PositionLogprobs | None],
    k: int,
    text_offset: int,
    decode: Callable[[int], str],
) -> CompletionLogprobs:
    """Parallel lists for `token_ids`; an entry of None (a prompt's first token) has no logprob, and its
    text comes from `decode`."""
    out = CompletionLogprobs()
    for tok, entry in zip(token_ids, entries, strict=True):
        own = entry.get(tok) if entry is not None else None
        s = _text(own) if own is not None else decode(tok)
        out.tokens.append(s)
        out.text_offset.append(text_offset)
        text_offset += len(s)
        if entry is None or own is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(_lp(own.logprob))
        top = {_text(lp): _lp(lp.logprob) for lp in _top(entry, k)}
        top.setdefault(s, _lp(own.logprob))
        out.top_logprobs.append(top)
    return out


def chat_logprobs(token_ids: Sequence[int], entries: Sequence[PositionLogprobs], k: int) -> ChatLogprobs:
    content = []
    for tok, entry in zip(token_ids, entries, strict=True):
        own = entry.get(tok)
        s = _text(own) if own is not None else ""
        content.append(
            ChatTokenLogprob(
                token=s,
                logprob=_lp(own.logprob) if own is not None else _MIN_LOGPROB,
                bytes=list(s.encode("utf-8")),
                top_logprobs=[
                    TopLogprob(token=_text(lp), logprob=_lp(lp.logprob), bytes=list(_text(lp).encode("utf-8")))
                    for lp in _top(entry, k)
                ],
            )
        )
    return ChatLogprobs(content=content)
