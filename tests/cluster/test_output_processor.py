"""The engine's one output road, without a model: scheduler sequences in, RequestDeltas out.

A byte-level tokenizer (one token per byte) makes every character one token, so the tests can put
several tokens into one step and place stop strings exactly. Milliseconds each.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from cluster.detokenizer import IncrementalDetokenizer
from cluster.output_processor import OutputProcessor, held_back_len
from cluster.outputs import RequestDelta, RequestOutputBuilder
from model_exec.source import ModelSource, load_tokenizer
from request.sampling_params import SamplingParams
from scheduler.sequence import Sequence, SequenceGroup, SequenceStatus
from tests.helpers.tiny_models import save_byte_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = tmp_path_factory.mktemp("tok")
    save_byte_tokenizer(path)
    return load_tokenizer(ModelSource("safetensors", str(path), None, "tok"))


def ids_of(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def make_group(tokenizer: Any, params: SamplingParams, num_seqs: int = 1) -> SequenceGroup:
    prompt = ids_of(tokenizer, "Q:")
    seqs = [Sequence(seq_id=i, prompt_token_ids=prompt, seed=0, sample_index=i) for i in range(num_seqs)]
    for s in seqs:
        s.status = SequenceStatus.RUNNING
    return SequenceGroup("r", "Q:", prompt, params, seqs, forked=num_seqs > 1)


def feed(tokenizer: Any, proc: OutputProcessor, group: SequenceGroup, per_step: list[list[str]]) -> list[RequestDelta]:
    """Append each step's texts (one string per sequence, one token per byte) and process the step; the
    sequences a stop string ended are finished as the engine finishes them."""
    deltas = []
    for texts in per_step:
        for seq, text in zip(group.seqs, texts, strict=True):
            if not seq.is_finished:
                seq.output_token_ids.extend(ids_of(tokenizer, text))
        out, stopped = proc.process([group])
        for seq, stop in stopped:
            seq.status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, stop
        deltas += out
    return deltas


def test_tokens_after_a_stop_string_in_the_same_step_are_dropped(tokenizer: Any) -> None:
    """Regression (issue 7, bug 1): a stop string completed mid-step ends the output at its last token."""
    proc = OutputProcessor(tokenizer)
    group = make_group(tokenizer, SamplingParams(stop=("ab",), max_tokens=100))
    proc.add_request(group)
    (delta,) = feed(tokenizer, proc, group, [["xabcd"]])  # five tokens in one step; "ab" completes at the third
    (s,) = delta.samples
    assert s.token_ids == ids_of(tokenizer, "xab") and s.text == "x"
    assert (s.finish_reason, s.stop_reason, delta.finished) == ("stop", "ab", True)
    assert group.seqs[0].is_finished  # the engine was told to finish it (here: the feed helper did)


def test_a_sample_stopped_by_a_string_is_handed_to_the_engine_at_once(tokenizer: Any) -> None:
    """Regression (issue 7, bug 2): with n=2 the stopped sample ends now, not when its sibling ends."""
    proc = OutputProcessor(tokenizer)
    group = make_group(tokenizer, SamplingParams(n=2, temperature=1.0, stop=("!",), max_tokens=100), num_seqs=2)
    proc.add_request(group)
    group.seqs[0].output_token_ids.extend(ids_of(tokenizer, "hi!"))
    group.seqs[1].output_token_ids.extend(ids_of(tokenizer, "hey"))
    (delta,), stopped = proc.process([group])
    assert [(seq.seq_id, stop) for seq, stop in stopped] == [(0, "!")]
    assert not delta.finished and [(s.index, s.finish_reason) for s in delta.samples] == [(0, "stop"), (1, None)]


def test_stop_strings_are_held_back_and_trimmed(tokenizer: Any) -> None:
    proc = OutputProcessor(tokenizer)
    group = make_group(tokenizer, SamplingParams(stop=("o w",), max_tokens=100))
    proc.add_request(group)
    deltas = feed(tokenizer, proc, group, [[c] for c in "Hello world, bye"])
    pieces = [s.text for d in deltas for s in d.samples]
    assert "".join(pieces) == "Hell" and all("o" not in p for p in pieces)
    final = deltas[-1].samples[0]
    assert (final.finish_reason, final.stop_reason) == ("stop", "o w")


def test_include_stop_str_and_partial_matches(tokenizer: Any) -> None:
    proc = OutputProcessor(tokenizer)
    group = make_group(tokenizer, SamplingParams(stop=("o w",), include_stop_str_in_output=True, max_tokens=100))
    proc.add_request(group)
    b = RequestOutputBuilder("r")
    for d in feed(tokenizer, proc, group, [[c] for c in "Hello world"]):
        b.add(d)
    assert b.build().outputs[0].text == "Hello w"
    # a partial match that never completes is released when the sample ends for another reason
    proc = OutputProcessor(tokenizer)
    group = make_group(tokenizer, SamplingParams(stop=("o wx",), max_tokens=100))
    proc.add_request(group)
    deltas = feed(tokenizer, proc, group, [[c] for c in "Hello w"])
    assert "".join(s.text for d in deltas for s in d.samples) == "Hell"  # "o w" waits
    group.seqs[0].status = SequenceStatus.FINISHED_LENGTH_CAPPED
    (last,), _ = proc.process([group])
    assert last.samples[0].text == "o w" and last.samples[0].finish_reason == "length" and last.finished


def test_min_tokens_defers_stop_strings(tokenizer: Any) -> None:
    proc = OutputProcessor(tokenizer)
    group = make_group(tokenizer, SamplingParams(stop=("ab",), min_tokens=4, max_tokens=100))
    proc.add_request(group)
    b = RequestOutputBuilder("r")
    for d in feed(tokenizer, proc, group, [[c] for c in "ab ab ab"]):
        b.add(d)
    out = b.build().outputs[0]
    assert (out.text, out.stop_reason, out.token_ids) == ("ab ", "ab", ids_of(tokenizer, "ab ab"))


def test_held_back_len() -> None:
    assert held_back_len("hello wo", ("world",)) == 2
    assert held_back_len("hello w", ("world", "xyz")) == 1
    assert held_back_len("hello", ("world",)) == 0
    assert held_back_len("abcab", ("abcabd",)) == 5
    assert held_back_len("ab", ("b", "abc")) == 2  # "b" itself would have matched: only proper prefixes count


def test_best_of_sends_only_the_n_best_once_all_finished(tokenizer: Any) -> None:
    proc = OutputProcessor(tokenizer)
    group = make_group(tokenizer, SamplingParams(n=1, best_of=3, temperature=1.0, max_tokens=2), num_seqs=3)
    proc.add_request(group)
    for seq, text, lp in zip(group.seqs, ["ab", "cd", "ef"], [-3.0, -1.0, -2.0], strict=True):
        seq.output_token_ids.extend(ids_of(tokenizer, text[0]))
        seq.cumulative_logprob = lp
    assert proc.process([group])[0] == []  # nothing before the choice is made
    for seq, text in zip(group.seqs, ["ab", "cd", "ef"], strict=True):
        seq.output_token_ids.extend(ids_of(tokenizer, text[1]))
        seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED
    (delta,), _ = proc.process([group])
    (s,) = delta.samples
    assert (s.index, s.text, delta.finished) == (0, "cd", True)  # the highest cumulative logprob


@pytest.mark.parametrize(("spaces", "expected"), [(True, "<x> <y> world"), (False, "<x><y> world")])
def test_spaces_between_special_tokens(spaces: bool, expected: str, tmp_path: Path) -> None:
    """Regression (issue 7, bug 6): the flag was accepted and ignored. False joins adjacent special tokens
    without the separator a decoder (here WordPiece's) puts between tokens, as vLLM's fast path does."""
    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "<x>": 3, "<y>": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()
    tok.add_special_tokens([AddedToken("<x>", special=True), AddedToken("<y>", special=True)])
    detok = IncrementalDetokenizer(PreTrainedTokenizerFast(tokenizer_object=tok))
    state = detok.start([1], skip_special_tokens=False, spaces_between_special_tokens=spaces)
    text = "".join(detok.step(state, t) for t in [3, 4, 2])
    assert text.strip() == expected
