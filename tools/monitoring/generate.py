"""Write (or check) the generated monitoring files the Helm chart mounts.

    python -m tools.monitoring.generate          # regenerate both files
    python -m tools.monitoring.generate --check  # exit 1 if either committed file is stale

Both come from the runtime registry (cluster/metrics/registry.py) through dashboard.py and alerts.py here;
never edit them by hand.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD_PATH = ROOT / "k8s" / "raytp" / "files" / "raytp-dashboard.json"
ALERTS_PATH = ROOT / "k8s" / "raytp" / "files" / "raytp-alerts.yaml"


def _dashboard() -> str:
    from tools.monitoring.grafana import dashboard_json  # needs grafana-foundation-sdk (test extra)

    return dashboard_json()


def _alerts() -> str:
    from tools.monitoring.alerts import rules_yaml

    return rules_yaml()


OUTPUTS: dict[Path, Callable[[], str]] = {DASHBOARD_PATH: _dashboard, ALERTS_PATH: _alerts}


def stale_files() -> list[Path]:
    """The generated files whose committed text differs from what the code generates now."""
    return [p for p, render in OUTPUTS.items() if not p.exists() or p.read_text() != render()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only report stale files; exit 1 if any")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files()
        for p in stale:
            print(f"stale: {p.relative_to(ROOT)} (run python -m tools.monitoring.generate)")
        return 1 if stale else 0
    for p, render in OUTPUTS.items():
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(render())
        print(f"wrote {p.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
