"""Incremental detokenization: each new token costs a decode of a few ids, never of the whole text.

vLLM's algorithm over the Rust `tokenizers` backend: a sequence keeps a short window of ids;
each step decodes `ids[prefix_offset:read_offset]` (already released) and `ids[prefix_offset:]`
and releases the difference, unless it ends in an incomplete UTF-8 character (U+FFFD), which
waits for the next token. Both windows stay a few tokens long, so the cost per token does not
grow with the context.

Decision (measured on the 2-core machine, busy, SmolLM2's tokenizer, 630 tokens): 1.5 us per
token through `backend_tokenizer.decode` against 12.6 us through the transformers wrapper's
`decode` (its Python argument handling dominates). At 256 sequences a step that is ~0.4 ms
against a forward pass of 50 ms or more, so detokenizing in the engine process costs nothing
that matters and lets stop strings end a sequence (and free its blocks) in the same step.

Text is the backend's own decoding (no `clean_up_tokenization_spaces`), as vLLM's fast
detokenizer does.

Byte-level tokenizers (a plain `ByteLevel` decoder: GPT-2, Llama 3, Qwen, SmolLM2) skip the backend: such a
decode is the UTF-8 bytes of the window's tokens decoded with U+FFFD for invalid sequences, which Python's
`bytes.decode("utf-8", "replace")` reproduces character for character (the Rust decoder's
`String::from_utf8_lossy` and CPython's both replace each maximal invalid subpart; checked against the backend
over random invalid byte windows, tests/cluster/test_detokenizer.py). The windows' bytes are kept instead, so
a token costs a concatenation and a short decode rather than two backend calls (~1.2 us each: at 256 rows
that was ~15% of a decode step's host time with a no-op model). Same windows, same text. A sequence whose
window takes an added token (special or not) goes back to the backend for good, since `skip_special_tokens`
and added-token decoding are the backend's; an id the tokenizer does not know decodes to nothing, as there.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, cast


def _byte_of_char() -> dict[str, int]:
    """The inverse of the ByteLevel alphabet (GPT-2's bytes_to_unicode): printable Latin-1 bytes stand for
    themselves, the other 68 bytes for the characters from U+0100 on, in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1), *range(ord("\u00ae"), 256)]
    shifted = [b for b in range(256) if b not in kept]
    return {chr(b): b for b in kept} | {chr(256 + k): b for k, b in enumerate(shifted)}


_BYTE_OF_CHAR = _byte_of_char()
_MISSING = object()
_PROMPT_CONTEXT = 6  # prompt ids decoded with the first output ids, so a leading space comes out right
_TRIM_AT = 64  # ids behind the window are dropped once this many pile up


@dataclass(slots=True)
class DetokState:
    """One sequence's window of ids; `ids[prefix_offset:read_offset]` is already turned into text."""

    ids: list[int]
    prefix_offset: int
    read_offset: int
    skip_special_tokens: bool
    join_specials: bool  # spaces_between_special_tokens=False: adjacent special tokens get no space between
    last_was_special: bool = False
    # Byte-level road (module docstring): the bytes of ids[prefix_offset:read_offset] and of ids[read_offset:],
    # and the first decoded once. prefix_bytes None: the backend decodes this sequence.
    prefix_bytes: bytes | None = None
    tail_bytes: bytes = b""
    prefix_text: str | None = None


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any) -> None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise ValueError(
                f"{type(tokenizer).__name__} has no Rust `tokenizers` backend; raytp needs a fast tokenizer "
                "(a tokenizer.json in the model directory)."
            )
        self._backend = backend
        # Every added token (special or not) and its raw text, for spaces_between_special_tokens=False.
        self._added: dict[int, str] = {i: t.content for i, t in backend.get_added_tokens_decoder().items()}
        self.decode_token = functools.lru_cache(maxsize=1 << 16)(self._decode_one)
        # Byte-level road: token id -> its bytes (None: an added token), filled as ids show up.
        decoder = type(backend.decoder)
        self._byte_level = (decoder.__module__, decoder.__name__) == ("tokenizers.decoders", "ByteLevel")
        self._bytes: dict[int, bytes | None] = {}

    def _decode_one(self, token_id: int) -> str:
        """One token's text with special tokens kept: what logprob entries show for it."""
        return str(self._backend.decode([token_id], skip_special_tokens=False))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self._backend.decode(ids, skip_special_tokens=skip_special_tokens))

    def start(
        self, prompt_token_ids: list[int], skip_special_tokens: bool, spaces_between_special_tokens: bool
    ) -> DetokState:
        context = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        prefix_bytes: bytes | None = None
        if self._byte_level:
            pieces = [self._bytes_of(i) for i in context]
            if None not in pieces:
                prefix_bytes = b"".join(cast(list[bytes], pieces))
        return DetokState(
            ids=context,
            prefix_offset=0,
            read_offset=len(context),
            skip_special_tokens=skip_special_tokens,
            join_specials=not skip_special_tokens and not spaces_between_special_tokens,
            prefix_bytes=prefix_bytes,
        )

    def _bytes_of(self, token_id: int) -> bytes | None:
        """What a ByteLevel decoder makes of one token: each character's byte (the token's own UTF-8 when a
        character is outside the byte alphabet); b"" for an unknown id; None for an added token."""
        piece = self._bytes.get(token_id, _MISSING)
        if piece is _MISSING:
            if token_id in self._added:
                piece = None
            else:
                token = self._backend.id_to_token(token_id)
                if token is None:
                    piece = b""
                elif all(c in _BYTE_OF_CHAR for c in token):
                    piece = bytes(_BYTE_OF_CHAR[c] for c in token)
                else:
                    piece = token.encode()
            self._bytes[token_id] = piece
        return cast(bytes | None, piece)

    def step(self, state: DetokState, token_id: int) -> str:
        """Append one id; return the newly readable text ("" while a multi-byte character is incomplete)."""
        ids = state.ids
        ids.append(token_id)
        skip = state.skip_special_tokens
        if state.prefix_bytes is not None:
            piece = self._bytes_of(token_id)
            if piece is None:
                state.prefix_bytes = None  # an added token: the backend's from now on
            else:
                state.tail_bytes += piece
        if state.prefix_bytes is not None:
            prefix_text = state.prefix_text
            if prefix_text is None:
                prefix_text = state.prefix_text = state.prefix_bytes.decode("utf-8", "replace")
            full_text = (state.prefix_bytes + state.tail_bytes).decode("utf-8", "replace")
        else:
            # the backend directly (not self.decode): this runs twice per token of every sequence
            decode = self._backend.decode
            prefix_text = decode(ids[state.prefix_offset : state.read_offset], skip)
            full_text = decode(ids[state.prefix_offset :], skip)
        text = ""
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            state.prefix_offset = state.read_offset
            state.read_offset = len(state.ids)
            text = full_text[len(prefix_text) :]
            if state.prefix_bytes is not None:  # the new prefix window is the old tail
                state.prefix_bytes, state.tail_bytes, state.prefix_text = state.tail_bytes, b"", None
            if state.prefix_offset > _TRIM_AT:  # keep the window short: drop ids already behind it
                del state.ids[: state.prefix_offset]
                state.read_offset -= state.prefix_offset
                state.prefix_offset = 0
        if state.join_specials:
            special = self._added.get(token_id)
            if special is not None and state.last_was_special:
                text = special  # the raw token, without any separator the decoder put before it
            state.last_was_special = special is not None
        return text
