"""`build_processor` over a Ray Dataset, on real Ray with a tiny random-weight model.

One local Ray per module and one processed dataset shared by most tests (engine starts dominate the
runtime): its rows mix completions and chat, a seeded n=2 row and rows the server would refuse, and
each test reads its part of the result. Greedy texts are checked against the offline `LLM`. The last
test runs its own dataset and kills its engine mid-way.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray

from raytp import LLM, SamplingParams
from raytp.batch import ProcessorConfig, build_processor
from raytp.batch.replica import CONTROLLER_PREFIX
from tests.batch.helpers import ENGINE
from tests.cluster.ray_helpers import ray_session  # noqa: F401  (a fixture: one local Ray per module)

pytestmark = pytest.mark.slow

ROWS: list[dict[str, Any]] = [
    {"id": "greedy", "kind": "completion", "text": "row 0:", "params": {"max_tokens": 6, "temperature": 0}},
    {"id": "chat", "kind": "chat", "text": "hi", "params": {"max_tokens": 5, "temperature": 0}},
    {"id": "n2", "kind": "completion", "text": "two", "params": {"max_tokens": 4, "n": 2, "seed": 7}},
    {"id": "bad-temperature", "kind": "completion", "text": "x", "params": {"temperature": -1}},
    {"id": "no-request", "kind": "none", "text": "", "params": {}},
]


def preprocess(row: dict[str, Any]) -> dict[str, Any]:
    out = {**row, "sampling_params": row["params"]}
    if row["kind"] == "completion":
        out["prompt"] = row["text"]
    elif row["kind"] == "chat":
        out["messages"] = [{"role": "user", "content": row["text"]}]
    return out


def postprocess(row: dict[str, Any]) -> dict[str, Any]:
    return {"answer": row["generated_text"], **row}


def test_the_processor_is_lazy(ray_session: None, tmp_path: Path) -> None:  # noqa: F811
    """Building the pipeline runs nothing: a model that does not exist is not even looked at."""
    config = ProcessorConfig(model_source=str(tmp_path / "no-such-model"), engine_kwargs=ENGINE)
    ds = build_processor(config, preprocess=preprocess)(ray.data.from_items(ROWS))
    assert isinstance(ds, ray.data.Dataset)
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    assert not [n for n in names if n.startswith(CONTROLLER_PREFIX)]


@pytest.fixture(scope="module")
def result(model_dir: str, ray_session: None) -> dict[str, dict[str, Any]]:  # noqa: F811
    """id -> output row of the whole dataset, processed once."""
    config = ProcessorConfig(model_source=model_dir, engine_kwargs=ENGINE, concurrency=1, batch_size=8)
    processor = build_processor(config, preprocess=preprocess, postprocess=postprocess)
    return {r["id"]: r for r in processor(ray.data.from_items(ROWS)).take_all()}


@pytest.fixture(scope="module")
def offline(model_dir: str) -> Iterator[LLM]:
    llm = LLM(model_dir, **ENGINE)
    yield llm
    llm.llm_engine.shutdown()


def test_greedy_text_equals_offline_llm(result: dict[str, dict[str, Any]], offline: LLM) -> None:
    out = offline.generate(["row 0:"], SamplingParams(max_tokens=6, temperature=0.0), use_tqdm=False)[0]
    row = result["greedy"]
    assert row["generated_text"] == out.outputs[0].text
    assert row["num_input_tokens"] == len(out.prompt_token_ids)
    assert row["num_generated_tokens"] == len(out.outputs[0].token_ids) == 6
    assert row["finish_reason"] == "length" and row["error"] is None and row["status_code"] == 200


def test_chat_and_n2_rows_are_answered_with_the_servers_bodies(result: dict[str, dict[str, Any]]) -> None:
    chat = result["chat"]
    body = json.loads(chat["response"])
    assert body["object"] == "chat.completion" and chat["error"] is None
    assert chat["generated_text"] == body["choices"][0]["message"]["content"]
    assert chat["num_generated_tokens"] == body["usage"]["completion_tokens"] > 0
    n2 = json.loads(result["n2"]["response"])
    assert n2["object"] == "text_completion" and len(n2["choices"]) == 2
    assert result["n2"]["num_generated_tokens"] == 8


def test_bad_rows_get_an_error_and_the_dataset_goes_on(result: dict[str, dict[str, Any]]) -> None:
    assert set(result) == {r["id"] for r in ROWS}
    bad = result["bad-temperature"]
    assert bad["status_code"] == 400 and "temperature" in bad["error"]
    assert json.loads(bad["response"])["error"]["param"] == "temperature"
    assert bad["generated_text"] is None and bad["num_generated_tokens"] is None
    none = result["no-request"]
    assert none["status_code"] == 400 and "prompt" in none["error"] and "messages" in none["error"]
    assert sum(r["error"] is None for r in result.values()) == 3


def test_columns_carried_through_and_postprocess_applied(result: dict[str, dict[str, Any]]) -> None:
    for src in ROWS:
        row = result[src["id"]]
        assert (row["kind"], row["text"]) == (src["kind"], src["text"])
        assert row["answer"] == row["generated_text"]
        assert "__raytp_request" not in row


def test_config_refuses_unknown_engine_options() -> None:
    with pytest.raises(ValueError, match="no_such_option"):
        ProcessorConfig(engine_kwargs={"no_such_option": 1})
    with pytest.raises(ValueError, match="concurrency"):
        ProcessorConfig(concurrency=0)


def _controllers() -> dict[str, str]:
    """name -> namespace of the batch engines alive now."""
    named = ray.util.list_named_actors(all_namespaces=True)
    return {a["name"]: a["namespace"] for a in named if a["name"].startswith(CONTROLLER_PREFIX)}


def test_rows_of_a_killed_engine_are_redone_on_a_fresh_one(
    model_dir: str,
    ray_session: None,  # noqa: F811
    offline: LLM,
) -> None:
    """The engine is killed once the first row is out; later batches meet the dead engine, the replica
    starts a fresh one and answers them: every row succeeds, greedy texts as offline.

    40 rows in batches of 2, so the batches after the first take seconds: with 10 rows, the engine once
    answered them all before this loop had killed it (CI, 2026-11-25)."""
    prompts = [f"kill {i}:" for i in range(40)]
    params = {"max_tokens": 32, "temperature": 0}
    rows = [{"i": i, "prompt": p, "sampling_params": params} for i, p in enumerate(prompts)]
    config = ProcessorConfig(model_source=model_dir, engine_kwargs=ENGINE, batch_size=2)
    ds = build_processor(config)(ray.data.from_items(rows))
    got: dict[int, dict[str, Any]] = {}
    killed: dict[str, str] = {}
    seen_after_kill: set[str] = set()
    for row in ds.iter_rows():
        got[int(row["i"])] = row
        if not killed:
            killed = _controllers()
            [(name, namespace)] = killed.items()
            ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
        else:
            seen_after_kill |= set(_controllers())
    assert seen_after_kill - set(killed), "no fresh engine was started: the kill came after every row was answered"
    expected = offline.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0), use_tqdm=False)
    assert sorted(got) == list(range(len(prompts)))
    for i, out in enumerate(expected):
        assert got[i]["error"] is None, got[i]["error"]
        assert got[i]["generated_text"] == out.outputs[0].text
