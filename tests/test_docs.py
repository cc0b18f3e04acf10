"""README and docs/ stay true where a machine can tell: CI runs README's test command, and every repository
path or relative link they name exists (a moved or renamed file shows up here, not in a reader's shell)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# `a/b/c.py`-like words in backticks; the first component decides whether it is a repository path.
_PATH = re.compile(r"`([A-Za-z0-9_.\-]+(?:/[A-Za-z0-9_.\-]+)+/?)`")
# A path that climbs out of the checkout (`../shared/x.md`) exists on a developer's machine and in no user's
# clone: a fresh clone's CI once failed on one, so such a path is refused outright, whether it exists here or not.
_OUTSIDE = re.compile(r"`((?:\./)*\.\./[^`\s]*)`")
_LINK = re.compile(r"\]\(([^)#\s]+)\)")


def test_readme_opens_with_the_two_commands_and_ci_runs_the_test_one() -> None:
    first_block = (ROOT / "README.md").read_text().split("```bash\n", 1)[1].split("```", 1)[0]
    assert "bash .ci/setup.sh && .venv/bin/raytp serve" in first_block
    assert "bash .ci/setup.sh && .venv/bin/python -m pytest -q" in first_block
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert "bash .ci/setup.sh" in ci_lines and ".venv/bin/python -m pytest -q" in ci_lines


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_named_files_exist(doc: Path) -> None:
    text = doc.read_text()
    outside = sorted({p for p in _OUTSIDE.findall(text) if not (ROOT / p).resolve().is_relative_to(ROOT)})
    local_links = [t for t in _LINK.findall(text) if not t.startswith(("http://", "https://"))]
    outside += sorted(t for t in local_links if not (doc.parent / t).resolve().is_relative_to(ROOT))
    assert not outside, f"{doc.name} names paths outside the repository: {outside}"
    # Only words whose first component is a top-level entry of the checkout (so `text/plain` is no path).
    paths = {p for p in _PATH.findall(text) if (ROOT / p.split("/")[0]).exists()}
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    links = {(doc.parent / t).resolve() for t in _LINK.findall(text) if not t.startswith(("http://", "https://"))}
    broken = sorted(str(t.relative_to(ROOT)) for t in links if not t.exists())
    assert not missing, f"{doc.name} names paths that do not exist: {missing}"
    assert not broken, f"{doc.name} links to files that do not exist: {broken}"


def test_readme_models_table_is_the_registrys(tmp_path: Path) -> None:
    """README's table of models is what `python -m tools.models_table` prints from the registry."""
    from tools.models_table import BEGIN, END, README, readme_table, table, update

    assert readme_table(README.read_text()) == table(), (
        "README's table of models differs from model_exec/architectures.py: run `python -m tools.models_table --update`"
    )
    stale = tmp_path / "README.md"
    stale.write_text(f"# x\n\n{BEGIN}\n| old |\n{END}\n\n## next\n")
    assert update(stale) and readme_table(stale.read_text()) == table() and stale.read_text().endswith("\n## next\n")
    assert not update(stale)


def test_every_benchmark_script_is_documented() -> None:
    """Each script in benchmarks/ is named in docs/benchmarks.md; shared helpers live in benchmarks/common/."""
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    scripts = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py"))
    undocumented = [s for s in scripts if not re.search(rf"benchmarks[./]{s}\b", text)]
    assert not undocumented, f"benchmarks/ scripts that docs/benchmarks.md does not name: {undocumented}"
