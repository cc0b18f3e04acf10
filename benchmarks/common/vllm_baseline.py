"""vLLM's CPU build as a side-by-side baseline: where it lives, how it is started, how it is driven.

vLLM runs from its own venv (`bash benchmarks/setup_vllm.sh` makes `.venv-vllm/`), never imported
here: offline runs go through `benchmarks/vllm_driver.py` in a subprocess, serving through vLLM's
OpenAI server. Its CPU backend is told to use both cores (without the binding it computes on one
thread) and fp32 (bf16 has no fast path on AVX2); the KV budget is the same 4 GiB raytp is given.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import IO, Any

from benchmarks.common.proc_mem import MemPeak, PeakSampler

REPO = Path(__file__).resolve().parents[2]
KV_CACHE_GIB = 4  # both engines' KV budget: VLLM_CPU_KVCACHE_SPACE and raytp's kv_cache_memory_bytes
KV_CACHE_BYTES = KV_CACHE_GIB << 30
DTYPE = "float32"


def vllm_python() -> Path:
    venv = Path(os.environ.get("VLLM_VENV", REPO / ".venv-vllm"))
    py = venv / "bin" / "python"
    if not py.is_file():
        sys.exit(f"no vLLM venv at {venv}: run `bash benchmarks/setup_vllm.sh` first (or set VLLM_VENV)")
    return py


def vllm_env() -> dict[str, str]:
    """The environment vLLM's CPU backend needs on this machine: every core bound, none reserved, 4 GiB KV."""
    cores = os.cpu_count() or 1
    return {
        **os.environ,
        "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", f"0-{cores - 1}"),
        "VLLM_CPU_NUM_OF_RESERVED_CPU": os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "0"),
        "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB),
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }


def server_command(model_dir: str, port: int) -> list[str]:
    """vLLM's OpenAI server (its console script looks for a distribution named `vllm`, so run the module)."""
    return [
        str(vllm_python()),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model_dir,
        "--dtype",
        DTYPE,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]


class VllmOffline:
    """vLLM's `LLM` in a driver subprocess; `generate` returns the seconds vLLM itself measured.

    Between its own calls vLLM is stopped (SIGSTOP to its process group, SIGCONT for the next call),
    so nothing it does while idle (its engine core and API processes poll their queues) can take CPU
    from raytp's rounds on a 2-core machine; raytp's engine runs in this process and is idle between
    its calls. vLLM's own timing starts after it is resumed. (The serving benchmark pauses each
    server's whole tree likewise: benchmarks/common/servers.py.)
    """

    def __init__(self, model_dir: str, log: IO[bytes] | None = None, seed: int = 0) -> None:
        read_fd, write_fd = os.pipe()
        self._proc = subprocess.Popen(
            [str(vllm_python()), str(REPO / "benchmarks" / "vllm_driver.py"), "--model", model_dir, "--dtype", DTYPE]
            + ["--seed", str(seed), "--reply-fd", str(write_fd)],
            env=vllm_env(),
            stdin=subprocess.PIPE,
            stdout=log or subprocess.DEVNULL,
            stderr=subprocess.STDOUT if log else subprocess.DEVNULL,
            pass_fds=(write_fd,),
            text=False,
            start_new_session=True,  # its own process group: _signal reaches the driver and vLLM's workers
        )
        os.close(write_fd)
        self._replies = os.fdopen(read_fd, "r")
        self.pid = self._proc.pid
        self.memory = PeakSampler(self.pid).start()
        self.load_s = 0.0
        self.config: dict[str, Any] = {}

    def wait_ready(self) -> None:
        """Blocks until the model is loaded (the driver's first reply)."""
        ready = self._reply()
        self.load_s = ready["load_s"]
        self.config = ready["config"]
        self._signal(signal.SIGSTOP)

    def _signal(self, sig: signal.Signals) -> None:
        if self._proc.poll() is None:
            os.killpg(self._proc.pid, sig)

    def _reply(self) -> dict[str, Any]:
        line = self._replies.readline()
        if not line:
            code = self._proc.wait()
            raise RuntimeError(f"vLLM driver exited with code {code} (rerun with --vllm-log FILE to see why)")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def generate(self, work: list[tuple[list[int], int]]) -> float:
        cmd = {"op": "generate", "prompts": [p for p, _ in work], "max_tokens": [n for _, n in work]}
        assert self._proc.stdin is not None
        self._signal(signal.SIGCONT)
        try:
            self._proc.stdin.write((json.dumps(cmd) + "\n").encode())
            self._proc.stdin.flush()
            reply = self._reply()
        finally:
            self._signal(signal.SIGSTOP)
        got, want = reply["output_tokens"], [n for _, n in work]
        if got != want:
            raise RuntimeError(f"vLLM generated {got} tokens, asked for {want}")
        elapsed: float = reply["elapsed_s"]
        return elapsed

    def close(self) -> MemPeak:
        peak = self.memory.stop()
        self._signal(signal.SIGCONT)
        if self._proc.poll() is None:
            assert self._proc.stdin is not None
            try:
                self._proc.stdin.write(b'{"op": "quit"}\n')
                self._proc.stdin.close()
                self._proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait()
        self._replies.close()
        return peak
