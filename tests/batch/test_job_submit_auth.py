"""README's `ray job submit -- raytp batch` sequence, as written, on a fresh `ray start --head`.

Ray 2.60 turns token authentication on for a `ray start --head` whenever ~/.ray/auth_token exists (and a
local `ray.init()`, as `raytp serve` runs, writes one), while `ray job submit` sends the token only when
RAY_AUTH_MODE=token: the README's bare `ray job submit` then failed. The documented sequence sets the mode
for the cluster and its clients alike and makes the token if it is missing. Here it runs in a HOME of its
own (no token yet: the fresh case) against a cluster of the test's own (private temp dir and ports, which
is all that differs from the README's `ray start --head`), and must answer every row.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from tests.helpers.ray_cluster import BIN, local_ray_cluster

# The README's lines, in order (README, "Batch jobs on a Ray cluster"); `ray stop` is left out here: it
# stops every Ray of this user on the machine, and the test stops only the cluster it started.
README_ENV = "export RAY_AUTH_MODE=token"
README_TOKEN = "ray get-auth-token --generate > /dev/null"
README_SUBMIT = "ray job submit --working-dir . -- raytp batch -i {input} -o {output}"


def test_the_readme_job_submit_sequence_runs_on_a_fresh_ray_start(tmp_path: Path) -> None:
    from tests.helpers.tiny_models import make_tiny_llama

    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    model = make_tiny_llama(tmp_path / "models")
    rows = [
        {"custom_id": f"r-{i}", "method": "POST", "url": "/v1/completions", "body": {"prompt": p, "max_tokens": 3}}
        for i, p in enumerate(["hello", "abc"])
    ]
    (work / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    env.update(HOME=str(home), PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}")

    def shell(script: str, extra: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", "-ec", f"{README_ENV}\n{script}"],
            cwd=work, env={**env, **(extra or {})}, capture_output=True, text=True, timeout=900,
        )  # fmt: skip

    made = shell(README_TOKEN)
    assert made.returncode == 0 and (home / ".ray" / "auth_token").is_file(), made.stderr
    env["RAY_AUTH_MODE"] = "token"  # README_ENV, for `ray start --head` (the helper runs it without a shell)
    with local_ray_cluster(env, tmp_path / "ray-start.log") as address:
        engine = f"{model} --max-model-len 128 --kv-cache-memory-bytes {1 << 22} --swap-space 0.01 --num-replicas 1"
        submit = README_SUBMIT.format(input=work / "in.jsonl", output=work / "out.jsonl") + " " + engine
        # RAY_ADDRESS names this test's cluster; the README's `ray start --head` listens on the default address.
        done = shell(submit, {"RAY_ADDRESS": address})
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    out = [json.loads(line) for line in (work / "out.jsonl").read_text().splitlines()]
    assert sorted(r["custom_id"] for r in out) == ["r-0", "r-1"]
    assert all(r["response"]["status_code"] == 200 for r in out), out
