"""The incremental detokenizer's byte-level road gives the backend's text, token for token.

A byte-level tokenizer without merges (one token per byte) makes invalid and incomplete UTF-8 easy to
produce: random streams of high bytes, added tokens and ids the tokenizer does not know are fed to a
detokenizer on the byte-level road and to one forced onto the backend, and every step's text must match.
The embedded SmolLM2 tokenizer (a real ByteLevel BPE with merges) is checked the same way.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from cluster.detokenizer import IncrementalDetokenizer
from model_exec.source import ModelSource, load_tokenizer, resolve_model
from tests.helpers.tiny_models import save_byte_tokenizer


@pytest.fixture(scope="module")
def byte_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = tmp_path_factory.mktemp("bytetok")
    save_byte_tokenizer(path)
    return load_tokenizer(ModelSource("safetensors", str(path), None, "tok"))


def _backend_only(tokenizer: Any) -> IncrementalDetokenizer:
    detok = IncrementalDetokenizer(tokenizer)
    detok._byte_level = False  # the reference: every window decoded by the Rust backend
    return detok


def _compare(tokenizer: Any, streams: list[tuple[list[int], list[int]]], skip: bool, spaces: bool) -> int:
    """Feed every (prompt, output) stream to both roads; returns how many steps took the byte-level road."""
    fast, reference = IncrementalDetokenizer(tokenizer), _backend_only(tokenizer)
    assert fast._byte_level, "the tokenizer's decoder is a plain ByteLevel: the fast road must be taken"
    on_fast_road = 0
    for prompt, output in streams:
        a, b = fast.start(prompt, skip, spaces), reference.start(prompt, skip, spaces)
        for token in output:
            on_fast_road += a.prefix_bytes is not None
            got, want = fast.step(a, token), reference.step(b, token)
            assert got == want, (prompt, output, token)
            assert (a.ids, a.prefix_offset, a.read_offset) == (b.ids, b.prefix_offset, b.read_offset)
    return on_fast_road


@pytest.mark.parametrize(("skip", "spaces"), [(True, True), (False, True), (False, False)])
def test_byte_level_road_matches_the_backend_on_invalid_utf8(byte_tokenizer: Any, skip: bool, spaces: bool) -> None:
    vocab = byte_tokenizer.backend_tokenizer.get_vocab()
    added = set(byte_tokenizer.backend_tokenizer.get_added_tokens_decoder())
    byte_ids = sorted(i for i in vocab.values() if i not in added)
    high = [i for i in byte_ids if byte_tokenizer.convert_ids_to_tokens(i) not in "".join(map(chr, range(33, 127)))]
    unknown = max(vocab.values()) + 5  # the backend decodes an id it does not know to nothing
    rng = random.Random(0)
    streams = []
    for k in range(400):
        pool = high if rng.random() < 0.7 else byte_ids
        prompt = [rng.choice(pool) for _ in range(rng.randint(1, 10))]
        output = [rng.choice(pool) for _ in range(rng.randint(1, 60))]
        if k % 5 == 0:  # an added token (special) somewhere: that sequence goes back to the backend
            output.insert(rng.randrange(len(output) + 1), rng.choice(sorted(added)))
        if k % 7 == 0:
            output.insert(rng.randrange(len(output) + 1), unknown)
        if k % 11 == 0:
            prompt.append(rng.choice(sorted(added)))
        streams.append((prompt, output))
    assert _compare(byte_tokenizer, streams, skip, spaces) > 0


def test_byte_level_road_matches_the_backend_on_a_bpe_with_merges(tmp_path: Path) -> None:
    tokenizer = load_tokenizer(resolve_model(None))
    vocab_size = len(tokenizer.backend_tokenizer.get_vocab())
    rng = random.Random(1)
    text = "Héllo wörld — ünïcode 漢字 emoji 🙂 and plain words, spaces  and\nnewlines. "
    ids = list(tokenizer.encode(text * 4, add_special_tokens=False))
    streams = [(ids[:5], ids[5:])]
    for _ in range(100):
        streams.append(([rng.randrange(vocab_size) for _ in range(6)], [rng.randrange(vocab_size) for _ in range(40)]))
    assert _compare(tokenizer, streams, True, True) > 0


def test_a_non_byte_level_decoder_keeps_the_backend(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "<unk>": 2}, unk_token="<unk>"))
    tok.decoder = decoders.WordPiece()
    detok = IncrementalDetokenizer(PreTrainedTokenizerFast(tokenizer_object=tok))
    state = detok.start([0], True, True)
    assert state.prefix_bytes is None
    assert detok.step(state, 1) == " b"
