"""The serving layer's pure parts, without a server: stop strings and hold-back, argument
parsing, the example Serve config, error mapping, logprob shapes. Milliseconds each."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from cluster.output_processor import IncrementalDetokenizer
from cluster.protocol import SeqDelta
from cluster.serving.builder import ServeArgs, build_app
from cluster.serving.errors import EngineOverloadedError, error_for_delta, to_openai_error, validation_error
from cluster.serving.logprobs import chat_logprobs, completion_logprobs
from cluster.serving.protocol import CompletionRequest
from cluster.serving.text_stream import SequenceText, stop_prefix_len
from scheduler.sampling_params import SamplingParams
from tests.helpers.tiny_models import save_byte_tokenizer

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tok")
    save_byte_tokenizer(path)
    return AutoTokenizer.from_pretrained(str(path))


def stream_text(tokenizer: Any, text: str, params: SamplingParams, finish_at_end: str | None = "length") -> Any:
    """Feed `text` one byte token per delta; returns (released pieces, the SequenceText)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    seq = SequenceText(0, params, IncrementalDetokenizer(tokenizer), tokenizer.encode("Q:", add_special_tokens=False))
    pieces: list[str] = []
    for i, tok in enumerate(ids):
        last = i == len(ids) - 1
        up = seq.apply(SeqDelta(0, [tok], None, -1.0 * i, finish_at_end if last else None))
        if up is not None:
            pieces.append(up.text)
        if seq.finished:
            break
    return pieces, seq


def test_stop_prefix_len() -> None:
    assert stop_prefix_len("hello wo", ("world",)) == 2
    assert stop_prefix_len("hello w", ("world", "xyz")) == 1
    assert stop_prefix_len("hello", ("world",)) == 0
    assert stop_prefix_len("abcab", ("abcabd",)) == 5
    assert stop_prefix_len("ab", ("b", "abc")) == 2  # "b" itself would have matched: only proper prefixes count


def test_stop_string_is_held_back_and_trimmed(tokenizer: Any) -> None:
    params = SamplingParams(stop=("o w",), max_tokens=100)
    pieces, seq = stream_text(tokenizer, "Hello world, bye", params)
    assert seq.text == "Hell" and "".join(pieces) == "Hell"
    assert seq.finish_reason == "stop" and seq.stop_reason == "o w" and seq.stopped_here
    # no piece ever showed a character of the stop string
    assert all("o" not in p for p in pieces)


def test_include_stop_str_and_no_stop(tokenizer: Any) -> None:
    pieces, seq = stream_text(
        tokenizer, "Hello world, bye", SamplingParams(stop=("o w",), include_stop_str_in_output=True)
    )
    assert "".join(pieces) == seq.text == "Hello w"
    # a partial match that never completes is released at the end
    pieces, seq = stream_text(tokenizer, "Hello wo", SamplingParams(stop=("o wx",)))
    assert "".join(pieces) == "Hello wo" and seq.finish_reason == "length"


def test_min_tokens_defers_stop_strings(tokenizer: Any) -> None:
    _, seq = stream_text(tokenizer, "ab ab ab", SamplingParams(stop=("ab",), min_tokens=4))
    assert seq.text == "ab " and seq.stop_reason == "ab"


def test_serve_args_parsing() -> None:
    sa = ServeArgs.from_dict({"model": "m", "tensor_parallel_size": 2, "num_replicas": 3, "api_key": "k"})
    assert sa.engine.model == "m" and sa.engine.tensor_parallel_size == 2 and sa.num_replicas == 3
    with pytest.raises(ValueError, match="unknown serve arguments: tensor_paralel_size"):
        ServeArgs.from_dict({"tensor_paralel_size": 2})
    with pytest.raises(ValueError, match="exclusive"):
        ServeArgs.from_dict({"num_replicas": 2, "autoscaling_config": {"max_replicas": 2}})
    with pytest.raises(ValueError, match="block_size"):
        ServeArgs.from_dict({"block_size": 3})


def test_example_serve_config_is_valid() -> None:
    from ray.serve.schema import ServeDeploySchema

    config = yaml.safe_load((ROOT / "cluster/serving/serve_config.example.yaml").read_text())
    schema = ServeDeploySchema.model_validate(config)
    (app,) = schema.applications
    assert app.import_path == "serve_app:build_app"
    build_app(app.args)  # every arg is accepted


def test_error_mapping() -> None:
    e = to_openai_error(ValueError("temperature must be non-negative, got -1."))
    assert (e.status, e.param, e.type) == (400, "temperature", "invalid_request_error")
    assert to_openai_error(EngineOverloadedError("busy")).status == 503
    assert error_for_delta("the prompt (600 tokens) is longer than max_model_len (512)").status == 400
    assert error_for_delta("engine failure: rank 1 died").status == 503
    try:
        CompletionRequest.model_validate({"prompt": [1.5]})
    except Exception as exc:
        err = validation_error(exc.errors())  # type: ignore[attr-defined]
        assert err.status == 400 and err.param == "prompt"


def test_logprob_shapes() -> None:
    decode = {5: "a", 6: "bc", 7: "d"}.__getitem__
    entries = [None, {6: (-0.5, 1), 7: (-1.5, 2)}, {7: (-3.0, 3), 5: (-0.1, 1), 6: (-0.2, 2)}]
    lp = completion_logprobs([5, 6, 7], entries, 1, decode, 10)
    assert lp.tokens == ["a", "bc", "d"] and lp.text_offset == [10, 11, 13]
    assert lp.token_logprobs == [None, -0.5, -3.0]
    assert lp.top_logprobs == [None, {"bc": -0.5}, {"a": -0.1, "d": -3.0}]  # top-1 plus the sampled token
    chat = chat_logprobs([7], [{7: (float("-inf"), 3), 5: (-0.1, 1), 6: (-0.2, 2)}], 2, decode)
    (entry,) = chat.content or []
    assert entry.logprob == -9999.0 and [t.token for t in entry.top_logprobs] == ["a", "bc"]
