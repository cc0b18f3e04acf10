"""The local Ray that raytp starts: no dashboard head by default, metrics still exported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Runs in a fresh interpreter: ensure_ray() only starts Ray when the process has none.
_PROBE = """
import json, time, urllib.request
import ray
from cluster.ray_utils import ensure_ray
from cluster.metrics.endpoint import node_metrics_urls
ensure_ray()
urls = node_metrics_urls()
page = ""
for _ in range(60):  # the node's metrics agent comes up shortly after ray.init returns
    try:
        page = urllib.request.urlopen(urls[0], timeout=5).read().decode()
        break
    except OSError:
        time.sleep(0.5)
print(json.dumps({"dashboard_url": ray._private.worker.get_dashboard_url(), "metrics": "# TYPE" in page}))
ray.shutdown()
"""


def _probe(dashboard: str | None) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAYTP_RAY_DASHBOARD")}
    if dashboard is not None:
        env["RAYTP_RAY_DASHBOARD"] = dashboard
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("dashboard", [None, "1"], ids=["default", "RAYTP_RAY_DASHBOARD=1"])
def test_local_ray_dashboard_is_opt_in_and_metrics_flow_either_way(dashboard: str | None) -> None:
    seen = _probe(dashboard)
    assert bool(seen["dashboard_url"]) == (dashboard == "1"), seen
    assert seen["metrics"], "the node's metrics agent must answer with or without the dashboard head"
