"""Content keys for automatic prefix caching.

A full block is keyed by a hash chained over every token before it and its own tokens, so two blocks share a
key only when the whole prefix up to and including them is equal.

Decision: SHA-256 rather than Python's ``hash``. A key collision would silently hand one request another
request's KV; with a 256-bit digest that is not a practical concern, and hashing costs about a microsecond per
block, paid once per block per sequence.

A chain may start from a salt instead of nothing: the first block's parent is then `salt_of(identity)`, so
sequences whose KV differs for the same tokens (a LoRA adapter changes every layer's K and V) never share a
block. Unsalted chains (the base model) keep exactly the keys they had before salts existed.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Sequence

BlockHash = bytes  # a 32-byte SHA-256 digest


def salt_of(identity: Sequence[int]) -> BlockHash:
    """The root a chain starts from for sequences whose KV depends on `identity` as well as on the tokens
    (the scheduler uses (lora_int_id, load generation)). Domain-separated from block keys by its prefix."""
    return hashlib.sha256(b"raytp-prefix-salt\x00" + array("q", identity).tobytes()).digest()


def hash_block(parent: BlockHash | None, tokens: Sequence[int]) -> BlockHash:
    """Key of a full block given the key of the block before it (None, or a salt, for the first block)."""
    # Token ids fit in int64. An unsalted first block's message lacks the 32-byte parent digest, so it is
    # shorter than any later block's message and the two can never be confused. A salted first block's message
    # has a later block's shape, but its parent is a salt, never a block key (they hash different domains).
    digest = hashlib.sha256(parent or b"")
    digest.update(array("q", tokens).tobytes())
    return digest.digest()


def hash_full_blocks(
    token_ids: Sequence[int],
    block_size: int,
    known: list[BlockHash],
    num_blocks: int,
    salt: BlockHash | None = None,
) -> list[BlockHash]:
    """Extend the chain `known` (keys of the leading blocks of `token_ids`, rooted at `salt`) to `num_blocks`
    full blocks.

    Returns the extended chain (a new list when it grows); `num_blocks` must not exceed the full blocks
    held by `token_ids`.
    """
    if len(known) >= num_blocks:
        return known
    assert num_blocks * block_size <= len(token_ids), "only full blocks have keys"
    chain = list(known)
    for i in range(len(chain), num_blocks):
        parent = chain[-1] if chain else salt
        chain.append(hash_block(parent, token_ids[i * block_size : (i + 1) * block_size]))
    return chain


def match_prefix(
    token_ids: Sequence[int],
    block_size: int,
    lookup: Callable[[BlockHash], int | None],
    salt: BlockHash | None = None,
) -> tuple[list[BlockHash], list[int]]:
    """Keys of the prompt's full blocks, and the cached blocks holding its leading ones.

    Only blocks lying entirely within the first len(token_ids) - 1 tokens may hit: the last token always runs
    so the model yields logits, and the block it is written to must not be a shared cached one.
    """
    chain = hash_full_blocks(token_ids, block_size, [], len(token_ids) // block_size, salt)
    hits: list[int] = []
    for key in chain[: (len(token_ids) - 1) // block_size]:
        block = lookup(key)
        if block is None:
            break  # keys chain: nothing after a miss can hit
        hits.append(block)
    return chain, hits
