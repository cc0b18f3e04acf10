"""Batch input, journal and output files without Ray or a model: validation, resume, exactly once."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from cluster.config import EngineConfig
from raytp.batch.input import body_hash, validate_file
from raytp.batch.journal import Journal
from raytp.batch.output import output_line, write_final
from raytp.batch.runner import BatchJob, BatchRefused, validate_only
from raytp.cli.main import main


def row(cid: str, prompt: str = "hi", url: str = "/v1/completions") -> dict[str, Any]:
    return {"custom_id": cid, "method": "POST", "url": url, "body": {"prompt": prompt, "max_tokens": 1}}


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_bad_file_is_refused_listing_each_line_before_anything_runs(tmp_path: Path, capsys: Any) -> None:
    src = write_lines(
        tmp_path / "in.jsonl",
        [
            json.dumps(row("a")),
            '{"custom_id": "b", "method": "POST", ',  # broken JSON
            json.dumps({"method": "POST", "url": "/v1/completions", "body": {}}),  # no custom_id
            json.dumps(row("c", url="/v1/audio/speech")),  # unknown url
            json.dumps(row("a")),  # duplicate id
            json.dumps(row("d", url="/v1/chat/completions")),
        ],
    )
    out = tmp_path / "out.jsonl"
    # No model flag resolves here: a refusal must come before any model (or Ray) is touched.
    rc = main(["batch", "-i", str(src), "-o", str(out), str(tmp_path / "no-such-model")])
    assert rc == 2
    listed = [json.loads(x) for x in capsys.readouterr().err.splitlines() if x.startswith("{")]
    assert [(e["line"], e["code"]) for e in listed] == [
        (2, "invalid_json_line"),
        (3, "missing_required_parameter"),
        (4, "invalid_url"),
        (5, "duplicate_custom_id"),
    ]
    assert listed[1]["param"] == "custom_id" and listed[2]["param"] == "url"
    assert not out.exists() and not Path(str(out) + ".journal").exists()
    status = json.loads(Path(str(out) + ".status.json").read_text())
    assert status["status"] == "failed" and len(status["errors"]["data"]) == 4


def test_journal_cuts_a_torn_last_line_and_never_commits_an_id_twice(tmp_path: Path) -> None:
    j = Journal(tmp_path / "j")
    j.append([("a", "h1", output_line("a", "r1", 200, {"x": 1}))])
    j.append([("a", "h1", output_line("a", "r2", 200, {"x": 2})), ("b", "h2", output_line("b", "r3", 200, {}))])
    j.close()
    with open(tmp_path / "j", "ab") as f:
        f.write(b'{"custom_id": "c", "hash": ')  # the driver died mid-write
    j = Journal(tmp_path / "j")
    assert j.done == {"a": "h1", "b": "h2"}
    j.append([("c", "h3", output_line("c", "r4", 400, {"error": {"code": "x", "message": "m"}}))])
    out, err = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    assert write_final(j, out, err) == (2, 1)
    j.close()
    ok = [json.loads(x) for x in out.read_text().splitlines()]
    assert [(x["custom_id"], x["response"]["body"]) for x in ok] == [("a", {"x": 1}), ("b", {})]
    assert [json.loads(x)["custom_id"] for x in err.read_text().splitlines()] == ["c"]


def test_a_reused_custom_id_with_another_body_is_refused(tmp_path: Path) -> None:
    src = write_lines(tmp_path / "in.jsonl", [json.dumps(row("a", "first")), json.dumps(row("b"))])
    job = BatchJob(str(src), str(tmp_path / "out.jsonl"), None, EngineConfig())
    j = Journal(job.journal_path)
    j.append([("a", body_hash("/v1/completions", row("a", "first")["body"]), output_line("a", "r", 200, {}))])
    j.close()
    assert validate_only(job).total == 2  # same body: resumes
    write_lines(src, [json.dumps(row("a", "second")), json.dumps(row("b"))])
    with pytest.raises(BatchRefused) as e:
        validate_only(job)
    assert [(x.line, x.code) for x in e.value.errors] == [(1, "custom_id_reused")]


# The peak is reset after the imports (Linux: writing 5 to clear_refs resets VmHWM), so what is
# measured is the reading alone, not the import of the package.
_RSS_SCRIPT = """
import sys
from raytp.batch.input import iter_rows, validate_file
def hwm():
    return next(int(x.split()[1]) for x in open("/proc/self/status") if x.startswith("VmHWM"))
def rss():
    return next(int(x.split()[1]) for x in open("/proc/self/status") if x.startswith("VmRSS"))
base = rss()
open("/proc/self/clear_refs", "w").write("5")
v = validate_file(sys.argv[1])
n = sum(1 for _ in iter_rows(sys.argv[1]))
assert v.total == n and not v.errors
print(hwm() - base)
"""


def _peak_rss_kib(path: Path) -> int:
    out = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, str(path)], check=True, capture_output=True, text=True)
    return int(out.stdout.strip())


def test_reading_and_validating_stay_flat_in_memory(tmp_path: Path) -> None:
    """Peak RSS growth of validating and streaming 2,000 vs 200,000 rows (~20 MB of JSON): the file is
    never held whole; only the custom_id set grows (~100 bytes an id)."""
    small = write_lines(tmp_path / "s.jsonl", [json.dumps(row(f"id-{i}", "x" * 40)) for i in range(2_000)])
    big = write_lines(tmp_path / "b.jsonl", [json.dumps(row(f"id-{i}", "x" * 40)) for i in range(200_000)])
    assert big.stat().st_size > 20_000_000
    rss_small, rss_big = _peak_rss_kib(small), _peak_rss_kib(big)
    print(f"peak RSS growth: 2,000 rows {rss_small / 1024:.1f} MiB, 200,000 rows {rss_big / 1024:.1f} MiB")
    # Holding the parsed rows would add hundreds of MB; the id set adds ~20 MB.
    assert rss_big - rss_small < 40 * 1024
    assert validate_file(small).total == 2_000


def test_rows_naming_a_model_not_served_are_refused_up_front(tmp_path: Path, capsys: Any) -> None:
    """The server would 404 them: the job refuses the file before Ray or the model starts, naming the served
    model (rows without a model, or naming the served one, pass)."""
    src = write_lines(
        tmp_path / "in.jsonl",
        [
            json.dumps(row("a")),
            json.dumps({**row("b"), "body": {**row("b")["body"], "model": "gpt-4o"}}),
            json.dumps({**row("c"), "body": {**row("c")["body"], "model": "tiny-served"}}),
        ],
    )
    rc = main(["batch", "-i", str(src), "-o", str(tmp_path / "out.jsonl"), "--served-model-name", "tiny-served"])
    assert rc == 2
    listed = [json.loads(x) for x in capsys.readouterr().err.splitlines() if x.startswith("{")]
    assert [(e["line"], e["code"], e["param"]) for e in listed] == [(2, "model_not_found", "body.model")]
    assert "tiny-served" in listed[0]["message"]


def test_a_file_for_several_models_names_one_in_every_row(tmp_path: Path, capsys: Any) -> None:
    """With --models-file, each row must name one of the job's models; the refusal lists them."""
    models = tmp_path / "models.yaml"
    models.write_text(
        "models:\n  - {model: /nowhere/a, served_model_name: a}\n  - {model: /nowhere/b, served_model_name: b}\n"
    )
    src = write_lines(
        tmp_path / "in.jsonl",
        [
            json.dumps({**row("a"), "body": {**row("a")["body"], "model": "a"}}),
            json.dumps(row("none")),
            json.dumps({**row("c"), "body": {**row("c")["body"], "model": "c"}}),
            json.dumps({**row("b"), "body": {**row("b")["body"], "model": "b"}}),
        ],
    )
    rc = main(["batch", "-i", str(src), "-o", str(tmp_path / "out.jsonl"), "--models-file", str(models)])
    assert rc == 2
    listed = [json.loads(x) for x in capsys.readouterr().err.splitlines() if x.startswith("{")]
    assert [(e["line"], e["code"], e["param"]) for e in listed] == [
        (2, "missing_required_parameter", "body.model"),
        (3, "model_not_found", "body.model"),
    ]
    assert "`a`, `b`" in listed[1]["message"]


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("models: []\n", "non-empty list"),
        (
            "models:\n  - {model: /x, served_model_name: a, tensor_parallel: 2}\n",
            "models[0] has unknown settings: tensor_parallel",
        ),
        (
            "models:\n  - {model: /x, served_model_name: a, tensor_parallel_size: 0}\n",
            "models[0]: tensor_parallel_size",
        ),
        ("models:\n  - {served_model_name: a}\n  - {served_model_name: a}\n", "served as a"),
    ],
)
def test_a_bad_models_file_is_refused_naming_the_entry(tmp_path: Path, capsys: Any, text: str, needle: str) -> None:
    models = tmp_path / "models.yaml"
    models.write_text(text)
    src = write_lines(tmp_path / "in.jsonl", [json.dumps(row("a"))])
    try:
        rc = main(["batch", "-i", str(src), "-o", str(tmp_path / "out.jsonl"), "--models-file", str(models)])
    except ValueError as e:  # a clash of served names is found when the job checks its rows
        rc, err = 2, str(e)
    else:
        err = capsys.readouterr().err
    assert rc == 2 and needle in err, err


def test_a_bad_adapter_is_refused_before_anything_runs(tmp_path: Path, capsys: Any) -> None:
    """`--lora-modules` with a path that holds no PEFT checkpoint, or without --enable-lora: exit 2 naming it."""
    src = write_lines(tmp_path / "in.jsonl", [json.dumps(row("a"))])
    out = str(tmp_path / "out.jsonl")
    assert main(["batch", "-i", str(src), "-o", out, "--enable-lora", "--lora-modules", "sql=/no/such/adapter"]) == 2
    err = capsys.readouterr().err
    assert "'sql'" in err and "/no/such/adapter" in err and "adapter_config.json" in err
    assert main(["batch", "-i", str(src), "-o", out, "--lora-modules", "sql=/no/such/adapter"]) == 2
    assert "need enable_lora" in capsys.readouterr().err
