"""Token logprobs in OpenAI's two shapes: legacy completions (parallel lists) and chat (objects).

The engine reports, per position, {token id: (logprob, rank)} holding the top-k plus the
sampled token. OpenAI's top lists hold the top-k only, plus the sampled token in the
completions shape (as vLLM does). -inf (a token masked out) is not JSON: it is clamped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from cluster.serving.protocol import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob
from scheduler.outputs import TokenLogprobs

_MIN_LOGPROB = -9999.0  # what -inf becomes (vLLM's choice too)

Decode = Callable[[int], str]


def _lp(x: float) -> float:
    return max(x, _MIN_LOGPROB)


def _top(entry: TokenLogprobs, k: int) -> list[tuple[int, float]]:
    ranked = sorted(entry.items(), key=lambda kv: kv[1][1])
    return [(tok, lp) for tok, (lp, rank) in ranked if rank <= k]


def completion_logprobs(
    token_ids: Sequence[int],
    entries: Sequence[TokenLogprobs | None],
    k: int,
    decode: Decode,
    text_offset: int,
) -> CompletionLogprobs:
    """Parallel lists for `token_ids`; an entry of None (a prompt's first token) has no logprob."""
    out = CompletionLogprobs()
    for tok, entry in zip(token_ids, entries, strict=True):
        s = decode(tok)
        out.tokens.append(s)
        out.text_offset.append(text_offset)
        text_offset += len(s)
        if entry is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(_lp(entry[tok][0]) if tok in entry else None)
        top = {decode(t): _lp(lp) for t, lp in _top(entry, k)}
        if tok in entry:
            top.setdefault(s, _lp(entry[tok][0]))
        out.top_logprobs.append(top)
    return out


def chat_logprobs(token_ids: Sequence[int], entries: Sequence[TokenLogprobs], k: int, decode: Decode) -> ChatLogprobs:
    content = []
    for tok, entry in zip(token_ids, entries, strict=True):
        s = decode(tok)
        content.append(
            ChatTokenLogprob(
                token=s,
                logprob=_lp(entry[tok][0]) if tok in entry else _MIN_LOGPROB,
                bytes=list(s.encode("utf-8")),
                top_logprobs=[
                    TopLogprob(token=(ts := decode(t)), logprob=_lp(lp), bytes=list(ts.encode("utf-8")))
                    for t, lp in _top(entry, k)
                ],
            )
        )
    return ChatLogprobs(content=content)
