"""Batch jobs over several models and LoRA adapters, on real Ray with tiny random-weight models.

A Ray of its own (8 logical CPUs). A finished pass frees its engines' worker placement groups (the groups belong
to the job, and Ray Data kills a retired replica's controller unshut): before that fix a two-model job left 2 of
8 CPUs held until the driver exited, and these tests, sharing test_run.py's cluster, found no CPU free.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.config import EngineConfig
from raytp.batch.runner import BatchJob, run_batch
from tests.batch.helpers import ENGINE, MODEL_NAME, by_id, engine_config, read_lines, write_rows
from tests.cluster.ray_helpers import live_placement_groups, wait_until
from tests.helpers.tiny_models import make_tiny_llama

pytestmark = pytest.mark.slow


def test_a_file_mixing_two_models_answers_each_row_with_its_own(
    tmp_path: Path, model_dir: str, cluster: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Rows naming `tiny` and `other` (another random model) in one file: each row's body equals what a job
    serving only its model answers, and names that model."""
    from raytp.batch.runner import BatchModel

    other_dir = make_tiny_llama(tmp_path_factory.mktemp("other"), seed=1)
    body = {"max_tokens": 8, "temperature": 0}
    rows = [
        {"custom_id": f"{m}-{i}", "method": "POST", "url": "/v1/completions",
         "body": {**body, "model": m, "prompt": f"row {i}:"}}
        for i in range(3) for m in (MODEL_NAME, "other")
    ]  # fmt: skip
    mixed = BatchJob(
        str(write_rows(tmp_path / "in.jsonl", rows)), str(tmp_path / "out.jsonl"), None, engine_config(model_dir),
        MODEL_NAME, show_progress=False, more_models=(BatchModel(engine_config(other_dir), "other"),),
    )  # fmt: skip
    assert run_batch(mixed).status == "completed"
    # a finished pass frees its engines' placement groups (removal lands within moments)
    wait_until(lambda: not live_placement_groups(), 10, f"the passes' groups to go: {live_placement_groups()}")
    got = by_id(read_lines(tmp_path / "out.jsonl"))
    assert set(got) == {r["custom_id"] for r in rows}
    only_other = [r for r in rows if r["body"]["model"] == "other"]
    alone = BatchJob(
        str(write_rows(tmp_path / "other.jsonl", only_other)), str(tmp_path / "alone.jsonl"), None,
        engine_config(other_dir), "other", show_progress=False,
    )  # fmt: skip
    run_batch(alone)
    want = by_id(read_lines(tmp_path / "alone.jsonl"))
    texts = {cid: body["choices"][0]["text"] for cid, (_, body) in got.items()}
    for cid, (status, body) in want.items():
        assert status == 200 and got[cid][1]["model"] == "other"
        assert texts[cid] == body["choices"][0]["text"], cid
    assert [got[f"{MODEL_NAME}-{i}"][1]["model"] for i in range(3)] == [MODEL_NAME] * 3
    assert any(texts[f"{MODEL_NAME}-{i}"] != texts[f"other-{i}"] for i in range(3)), "the two models look alike"


def test_rows_naming_an_adapter_run_with_it(tmp_path: Path, model_dir: str, cluster: str) -> None:
    """`--lora-modules` in a batch job: a row naming the adapter as `model` gets what the offline engine gives
    with that adapter, a row naming the base model the base model's answer, both in one engine."""
    from raytp import LLM, LoRARequest, SamplingParams
    from raytp.serve.args import LoRAModule
    from tests.helpers.lora_models import make_peft_adapter

    adapter = make_peft_adapter(model_dir, tmp_path / "sql", rank=8, seed=1)
    lora_engine = {**ENGINE, "enable_lora": True, "max_loras": 2}
    llm = LLM(model_dir, **lora_engine)  # type: ignore[arg-type]
    greedy = SamplingParams(temperature=0, max_tokens=8)
    try:
        want = {
            "base": llm.generate(["row 0:"], greedy)[0].outputs[0].text,
            "sql": llm.generate(["row 0:"], greedy, lora_request=LoRARequest("sql", 1, adapter))[0].outputs[0].text,
        }
    finally:
        llm.llm_engine.shutdown()
    assert want["base"] != want["sql"], "the adapter must change the answer"
    rows = [
        {"custom_id": m, "method": "POST", "url": "/v1/completions",
         "body": {"model": MODEL_NAME if m == "base" else m, "prompt": "row 0:", "max_tokens": 8, "temperature": 0}}
        for m in ("base", "sql")
    ]  # fmt: skip
    job = BatchJob(
        str(write_rows(tmp_path / "in.jsonl", rows)), str(tmp_path / "out.jsonl"), None,
        EngineConfig(model=model_dir, **lora_engine), MODEL_NAME, show_progress=False,  # type: ignore[arg-type]
        lora_modules=(LoRAModule("sql", adapter),),
    )  # fmt: skip
    assert run_batch(job).status == "completed"
    got = by_id(read_lines(tmp_path / "out.jsonl"))
    assert {cid: body["choices"][0]["text"] for cid, (_, body) in got.items()} == want
    assert got["sql"][1]["model"] == "sql"
