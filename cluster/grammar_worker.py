"""The grammar compile worker: a child process that turns a structured-output spec into an llguidance
grammar and builds a matcher from it, so that a native crash in the grammar library kills this child,
never the process that serves (issue 36).

Why a process: llguidance overflows its native stack on some specs that fit every bound we can state
cheaply (a Lark grammar of a 3,000-rule chain is 36 KB; a JSON schema 1,000-2,000 `$ref`s deep), and a
segfault cannot be caught in-process. vLLM compiles in-process; here the child does the risky part
(schema -> grammar, grammar -> matcher) and answers with the grammar text. The controller then builds its
own matcher from that text, the same construction with the same tokenizer that just succeeded in the
child, so its matchers stay in-process and torch-free (masks never cross a process boundary).

Protocol (stdin/stdout of the child, each message a 4-byte big-endian length and UTF-8 JSON):
    parent -> child   {"tokenizer": str, "n_vocab": int, "eos": [int]}    once, first
    child -> parent   {"ready": true}                                    once its tokenizer is built
    parent -> child   {"spec": {StructuredOutputsParams fields}}
    child -> parent   {"grammar": str} | {"error": str}
The child runs `python -m cluster.grammar_worker` and imports neither torch nor ray (~0.5 s to start,
~0.4 s to build its tokenizer); it exits when its stdin closes (the parent died or shut it down).
"""

from __future__ import annotations

import dataclasses
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from typing import IO, Any

from cluster.grammars import to_grammar
from request.errors import RequestError
from request.structured_outputs import StructuredOutputsParams

# A compile the child has not answered in this long is killed and refused: llguidance's parser limits
# bound a compile to well under a second on a sane spec (docs/openai_contract.md, limits).
COMPILE_TIMEOUT_S = 10.0
# A new child's start (interpreter, llguidance, its tokenizer: ~1 s idle) is not charged to the first spec:
# on a loaded machine it took 10 s, and a spec must not be refused for the machine's load.
STARTUP_TIMEOUT_S = 120.0


def _write(out: IO[bytes], msg: dict[str, Any]) -> None:
    data = json.dumps(msg, default=list).encode()  # tuples (a choice) as lists, as the spec's key writes them
    out.write(len(data).to_bytes(4, "big") + data)
    out.flush()


def _read_exact(fd: int, n: int, deadline: float | None) -> bytes:
    """n bytes from a pipe; EOFError when the writer is gone, TimeoutError past the deadline."""
    buf = b""
    while len(buf) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return buf


def _read(fd: int, deadline: float | None = None) -> dict[str, Any]:
    size = int.from_bytes(_read_exact(fd, 4, deadline), "big")
    result: dict[str, Any] = json.loads(_read_exact(fd, size, deadline))
    return result


def spec_fields(spec: StructuredOutputsParams) -> dict[str, Any]:
    """The spec as JSON-able keyword arguments (a choice tuple becomes a list)."""
    return {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}


class GrammarCompileWorker:
    """The parent's handle on the child. One compile at a time (the manager calls it from its one grammar
    thread; the lock makes any other caller wait). A child that dies or hangs on a spec is replaced at once
    and the spec is a RequestError naming its field; the next spec goes to the new child."""

    def __init__(self, tokenizer_json: str, n_vocab: int, eos: list[int], timeout_s: float = COMPILE_TIMEOUT_S):
        self._init = {"tokenizer": tokenizer_json, "n_vocab": n_vocab, "eos": eos}
        self.timeout_s = timeout_s
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()
        self._ready = False
        self.restarts = 0  # children replaced after a crash or a timeout

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self) -> None:
        """Start the child unless it runs (returns at once: it builds its tokenizer while the caller works)."""
        with self._lock:
            self._ensure()

    def _ensure(self) -> subprocess.Popen[bytes]:
        if self._proc is None or self._proc.poll() is not None:
            env = dict(os.environ)
            # The parent's import path, so the child imports the same raytp (a Ray worker's path may hold
            # entries its environment does not).
            env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "cluster.grammar_worker"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
            )
            assert self._proc.stdin is not None
            _write(self._proc.stdin, self._init)
            self._ready = False  # until the child says its tokenizer is built
        return self._proc

    def compile(self, spec: StructuredOutputsParams) -> str:
        """The spec's llguidance grammar, validated by building a matcher in the child. RequestError when it
        does not compile, when the child crashes on it, or when it runs past the timeout."""
        with self._lock:
            proc = self._ensure()
            assert proc.stdin is not None and proc.stdout is not None
            try:
                if not self._ready:
                    _read(proc.stdout.fileno(), time.monotonic() + STARTUP_TIMEOUT_S)
                    self._ready = True
                _write(proc.stdin, {"spec": spec_fields(spec)})
                reply = _read(proc.stdout.fileno(), time.monotonic() + self.timeout_s)
            except (BrokenPipeError, EOFError, TimeoutError) as e:
                why = self._replace(proc, timed_out=isinstance(e, TimeoutError))
                raise RequestError(
                    f"{spec.field}: the {spec.kind} constraint cannot be compiled: {why}; the spec is refused.",
                    spec.field,
                    code="grammar_compile_failed",
                ) from None
        if "error" in reply:
            raise RequestError(reply["error"], spec.field)
        grammar: str = reply["grammar"]
        return grammar

    def _replace(self, proc: subprocess.Popen[bytes], timed_out: bool) -> str:
        proc.kill()
        code = proc.wait()
        self.restarts += 1
        self._proc = None
        self._ensure()  # the next spec finds a child already starting
        if timed_out:
            return f"the grammar compiler did not finish within {self.timeout_s:g} s"
        name = signal.Signals(-code).name if code < 0 and -code in signal.Signals._value2member_map_ else code
        return f"the grammar compiler crashed on it ({name})"

    def shutdown(self) -> None:
        with self._lock:
            if self._proc is not None:
                self._proc.kill()
                self._proc.wait()
                self._proc = None


def _serve() -> None:
    import llguidance
    import llguidance.numpy as llg_np

    fd = sys.stdin.buffer.fileno()
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything printed goes to stderr, never into the protocol
    init = _read(fd)
    tokenizer = llguidance.LLTokenizer(init["tokenizer"], n_vocab=init["n_vocab"], eos_token=init["eos"])
    _write(out, {"ready": True})
    while True:
        try:
            msg = _read(fd)
        except EOFError:
            return
        try:
            spec = StructuredOutputsParams(**msg["spec"])
            grammar = to_grammar(spec)
            matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=llguidance.LLParserLimits())
            if matcher.is_error():
                raise RequestError(
                    f"{spec.field}: the {spec.kind} constraint cannot be compiled: {matcher.get_error()}", spec.field
                )
            # The first mask, here too: a grammar whose language is empty (`start: x` / `x: x x`, no terminal)
            # puts the matcher in error (NoExtensionBias) or allows no token, and a sample would fail at once.
            mask = llg_np.allocate_token_bitmask(1, init["n_vocab"])
            llg_np.fill_next_token_bitmask(matcher, mask, 0)
            if matcher.is_error() or not mask.any():
                why = "it matches no text at all" if not mask.any() else matcher.get_error()
                raise RequestError(f"{spec.field}: the {spec.kind} constraint cannot be compiled: {why}", spec.field)
            _write(out, {"grammar": grammar})
        except (RequestError, ValueError, TypeError) as e:
            _write(out, {"error": str(e)})


if __name__ == "__main__":
    _serve()
