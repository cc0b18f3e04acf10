"""The model's generation_config.json as sampling defaults (vLLM's `--generation-config auto | vllm | FOLDER`):
read torch-free, refused when bad, applied offline by `LLM` to calls without SamplingParams and by the OpenAI
request mapping to fields a request leaves unset (the live HTTP check is tests/serving/test_generation_defaults.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from cluster.config import EngineConfig
from model_exec.generation_config import sampling_defaults
from model_exec.source import read_model_config, resolve_model
from raytp.openai.protocol import ChatCompletionRequest, CompletionRequest
from raytp.openai.requests import resolve_max_tokens, to_sampling_params
from request.sampling_params import SamplingParams
from tests.helpers.tiny_models import EOS_ID, make_tiny_llama

SMALL = dict(max_model_len=128, block_size=8, kv_cache_memory_bytes=8 << 20)
# top_k 1 samples greedily at any temperature: deterministic, and unlike SamplingParams' own defaults (random)
GREEDY_BY_TOP_K = {"temperature": 0.7, "top_k": 1, "max_new_tokens": 9, "top_p": None}
PROMPTS = [[5, 17, 33, 17, 5, 17], [42, 42, 42], [3 + (7 * i) % 250 for i in range(13)]]


def _with_generation_config(path: str | Path, fields: dict[str, Any]) -> str:
    gen = Path(path, "generation_config.json")
    existing = json.loads(gen.read_text()) if gen.is_file() else {}
    gen.write_text(json.dumps({**existing, **fields}))
    return str(path)


@pytest.fixture(scope="module")
def tiny_with_defaults(tmp_path_factory: pytest.TempPathFactory) -> str:
    return _with_generation_config(make_tiny_llama(tmp_path_factory.mktemp("gen")), GREEDY_BY_TOP_K)


def test_defaults_are_read_as_vllm_reads_them(tmp_path: Path) -> None:
    model = make_tiny_llama(tmp_path)
    src = resolve_model(model)
    assert sampling_defaults(src, "auto") == {}  # save_pretrained's file sets only token ids
    fields = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0, "repetition_penalty": 1.1}
    _with_generation_config(model, {**fields, "max_new_tokens": 300, "do_sample": True, "typical_p": None})
    assert sampling_defaults(src, "auto") == {**fields, "max_tokens": 300}  # HF's max_new_tokens is max_tokens
    assert sampling_defaults(src, "vllm") == {}

    folder = tmp_path / "override"
    folder.mkdir()
    _with_generation_config(folder, {"temperature": 0.3, "eos_token_id": [EOS_ID, 9]})
    assert sampling_defaults(src, str(folder)) == {"temperature": 0.3}
    assert read_model_config(src, generation_config=str(folder)).eos_token_ids == (EOS_ID, 9)


def test_bad_settings_and_files_are_refused(tmp_path: Path) -> None:
    model = make_tiny_llama(tmp_path)
    src = resolve_model(model)
    with pytest.raises(ValueError, match="generation_config must be"):
        EngineConfig(generation_config="")
    with pytest.raises(ValueError, match="no generation_config.json in that folder"):
        sampling_defaults(src, str(tmp_path / "nowhere"))
    _with_generation_config(model, {"top_p": 1.5})
    with pytest.raises(ValueError, match=r"generation_config\.json: top_p must be in \(0, 1\]"):
        sampling_defaults(src, "auto")


def test_openai_fields_left_unset_take_the_defaults() -> None:
    defaults = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1}
    messages = [{"role": "user", "content": "hi"}]
    omitted = to_sampling_params(ChatCompletionRequest(messages=messages), max_tokens=None, defaults=defaults)
    nulls = ChatCompletionRequest.model_validate({"messages": messages, **dict.fromkeys(defaults)})
    assert to_sampling_params(nulls, max_tokens=None, defaults=defaults) == omitted
    assert omitted == SamplingParams(max_tokens=None, **defaults)
    given = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}
    explicit = to_sampling_params(CompletionRequest(prompt="x", **given), max_tokens=16, defaults=defaults)
    assert explicit == SamplingParams(max_tokens=16, **given)  # what a request sets wins
    builtin = to_sampling_params(CompletionRequest(prompt="x"), max_tokens=16, defaults={})
    assert builtin == SamplingParams(max_tokens=16)
    # the model's max_new_tokens applies when the request sets no length, capped at what fits
    assert resolve_max_tokens(None, 10, 100, "max_tokens", default=50) == 50
    assert resolve_max_tokens(None, 80, 100, "max_tokens", default=50) == 20
    assert resolve_max_tokens(30, 10, 100, "max_tokens", default=50) == 30
    assert resolve_max_tokens(None, 10, 100, "max_tokens") is None


def _tokens(outputs: list[Any]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_offline_llm_applies_the_defaults_when_given_no_params(tiny_with_defaults: str) -> None:
    from raytp import LLM

    llm = LLM(tiny_with_defaults, **SMALL)
    try:
        prompts = [{"prompt_token_ids": p} for p in PROMPTS]
        implicit = llm.generate(prompts, use_tqdm=False)
        greedy = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=9), use_tqdm=False)
        assert _tokens(implicit) == _tokens(greedy)
        assert all(len(o.outputs[0].token_ids) == 9 for o in greedy if o.outputs[0].finish_reason == "length")
        chat = [{"role": "user", "content": "hello hello"}]
        chat_greedy = llm.chat(chat, SamplingParams(temperature=0.0, max_tokens=9), use_tqdm=False)
        assert _tokens(llm.chat(chat, use_tqdm=False)) == _tokens(chat_greedy)
        assert llm.get_default_sampling_params() == SamplingParams(temperature=0.7, top_k=1, max_tokens=9)
    finally:
        llm.llm_engine.shutdown()


def test_vllm_setting_and_a_folder_replace_the_models_defaults(tiny_with_defaults: str, tmp_path: Path) -> None:
    from raytp import LLM

    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    llm = LLM(tiny_with_defaults, generation_config="vllm", **SMALL)
    try:
        assert llm.get_default_sampling_params() == SamplingParams()
        outs = llm.generate(prompts, use_tqdm=False)  # SamplingParams(): 16 tokens unless EOS comes first
        assert all(len(o.outputs[0].token_ids) == 16 or o.outputs[0].finish_reason == "stop" for o in outs)
        plain = _tokens(llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False))
    finally:
        llm.llm_engine.shutdown()
    folder = Path(_with_generation_config(tmp_path, {"temperature": 0.0, "max_new_tokens": 5}))
    llm = LLM(tiny_with_defaults, generation_config=str(folder), **SMALL)
    try:
        assert _tokens(llm.generate(prompts, use_tqdm=False)) == plain  # greedy, no penalty: the folder's file
    finally:
        llm.llm_engine.shutdown()


def test_generate_command_flags_left_unset_take_the_defaults(
    tiny_with_defaults: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from raytp.cli.main import main as cli_main

    engine = ["--model", tiny_with_defaults, "--max-model-len", "128", "--kv-cache-memory-bytes", str(8 << 20)]
    for flags, expected_len in (([], 9), (["--max-tokens", "3"], 3)):  # the model's max_new_tokens, or the flag
        capsys.readouterr()
        assert cli_main(["generate", "--prompt", "abc", "--ignore-eos", "--json", *engine, *flags]) == 0
        (record,) = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
        assert len(record["outputs"][0]["token_ids"]) == expected_len
