"""What users install is what the tests run: the wheel carries the C++ kernels' sources and works non-editable.

CI installs raytp editable, so a source file left out of the wheel (as `ops/csrc/` was: every C++ CPU kernel
then failed to load in `k8s/Dockerfile`'s image and the engine fell back to torch) is invisible to the rest
of the suite. Here the wheel is built from a clean copy of the distribution's sources (an in-tree build keeps
stale files in `build/`), its file list is checked against the kernel loader's own source lists, and (slow)
it is installed, not editable, into a fresh venv where the kernels are compiled from the wheel's copies and
one request is answered.
"""

from __future__ import annotations

import fnmatch
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest

from ops.attention import cpu_kernels

ROOT = Path(__file__).resolve().parents[1]
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def _distribution_sources(dest: Path) -> None:
    """Copy what pyproject.toml declares as the distribution (its packages, modules and readme) to `dest`."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    setuptools_config = config["tool"]["setuptools"]
    patterns = setuptools_config["packages"]["find"]["include"]
    shutil.copy2(ROOT / "pyproject.toml", dest)
    shutil.copy2(ROOT / config["project"]["readme"], dest)
    for module in setuptools_config.get("py-modules", []):
        shutil.copy2(ROOT / f"{module}.py", dest)
    for top in sorted(ROOT.iterdir()):
        if (top / "__init__.py").is_file() and any(fnmatch.fnmatch(top.name, p) for p in patterns):
            shutil.copytree(top, dest / top.name, ignore=shutil.ignore_patterns("__pycache__"))


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    source = tmp_path_factory.mktemp("source")
    out = tmp_path_factory.mktemp("dist")
    _distribution_sources(source)
    # --no-build-isolation: no index needed; the test venv's setuptools (a dependency of torch) builds it.
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), "."],
        cwd=source,
        check=True,
    )
    (built,) = out.glob("raytp-*.whl")
    return built


def _kernel_files() -> set[str]:
    """Every file the kernel build reads, repo-relative: the loader's sources and headers, and each header
    those files include by a quoted path (so a new header not yet listed in `_HEADERS` is caught too)."""
    found: set[Path] = set()
    pending = [p.resolve() for p in (*cpu_kernels._SOURCES, *cpu_kernels._HEADERS)]
    while pending:
        path = pending.pop()
        if path in found:
            continue
        found.add(path)
        pending += [(path.parent / name).resolve() for name in _INCLUDE.findall(path.read_text())]
    return {p.relative_to(ROOT).as_posix() for p in found}


def test_wheel_carries_every_kernel_source(wheel: Path) -> None:
    needed = _kernel_files()
    assert "ops/csrc/vec_math.h" in needed  # the include scan sees the shared header
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    missing = sorted(needed - names)
    assert not missing, f"{wheel.name} lacks {missing}: add them to [tool.setuptools.package-data] in pyproject.toml"


def test_wheel_leaves_out_build_time_tools(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        shipped = sorted(n for n in archive.namelist() if n.startswith(("tools/", "tests/", "benchmarks/")))
    assert not shipped, f"{wheel.name} ships build-time or test files: {shipped[:5]}"


def _venv_with_wheel(venv: Path, wheel: Path) -> Path:
    """A fresh venv with the wheel installed (not editable, no deps); the dependencies (torch, ray, the default
    model) are borrowed from the test interpreter's site-packages through a .pth, which appends them to
    sys.path after the venv's own site-packages, so raytp is imported from the wheel. Paths a .pth adds are
    not scanned for .pth files, so the editable install's finder there stays inactive."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", str(wheel)], check=True
    )
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    deps = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    (Path(site) / "raytp_test_deps.pth").write_text("".join(f"{d}\n" for d in deps))
    return venv / "bin"


@pytest.mark.slow
def test_installed_wheel_loads_kernels_and_answers(wheel: Path, tmp_path: Path) -> None:
    bin_dir = _venv_with_wheel(tmp_path / "venv", wheel)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # A fresh extension cache: the kernels are compiled from the wheel's sources (~20 s on 2 cores), not
    # found already built from the checkout's.
    env["TORCH_EXTENSIONS_DIR"] = str(tmp_path / "torch_extensions")
    outside = tmp_path / "cwd"  # not the checkout, whose packages would shadow the installed ones
    outside.mkdir()
    probe = "import ops; from ops.attention import cpu_kernels;print(ops.__file__); print(cpu_kernels.load_error())"
    loaded = subprocess.run(
        [str(bin_dir / "python"), "-c", probe], cwd=outside, env=env, capture_output=True, text=True, timeout=300
    )
    assert loaded.returncode == 0, loaded.stderr
    location, error = loaded.stdout.splitlines()[-2:]
    assert Path(location).is_relative_to(tmp_path / "venv"), f"ops imported from {location}, not the wheel"
    assert error == "None", f"the installed wheel's C++ kernels did not load: {error}"

    # The console script from the wheel, with the C++ attention backend required (no torch fallback).
    answered = subprocess.run(
        [str(bin_dir / "raytp"), "generate", "--prompt", "The capital of France is", "--max-tokens", "4",
         "--temperature", "0", "--json", "--attention-backend", "cpu"],
        cwd=outside, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert answered.returncode == 0, answered.stderr[-3000:]
    assert '"finish_reason": "length"' in answered.stdout, answered.stdout
