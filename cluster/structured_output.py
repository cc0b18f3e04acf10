"""Structured outputs on the controller: grammars compiled off the engine loop, one matcher per sample, and
each step's token bitmask for the constrained rows.

Decision (measured, `python -m benchmarks.structured_output --compare-libraries`): the grammar library is
llguidance, not xgrammar. Both compile a 5-property JSON schema on the SmolLM2 tokenizer in milliseconds
and mask a token in microseconds, but xgrammar requires torch (and triton), and llguidance needs nothing:
the matchers can then live here, in the torch-free controller, as vLLM keeps them in its scheduler process.
Matcher state then never crosses a process boundary: preemption (recompute or swap), chunked prefill and
prefix-cache hits leave it as it is, and TP ranks receive only the step's bitmask (rank 0 applies it).

Compilation: a spec compiles once into a template matcher (grammar built, lexer ready), cached by the
spec's canonical key; each sample gets a deep copy. Compiles run on a thread of their own (llguidance
drops the GIL while it builds), so the engine loop never waits for one: the serving path awaits `prepare`
before it adds the request, and a spec that does not compile is a RequestError naming the request field.
Hostile specs meet three walls: the spec's bounds (request/structured_limits.py: depth with refs
expanded, size, enums, regex and grammar lengths) before any library runs; the compile worker
(cluster/grammar_worker.py), a child process that builds the grammar and a matcher first, so a native
crash kills it and not this process (the spec is a 400, the child is replaced); and llguidance's parser
limits (grammar size, lexer fuel per step), so a spec that compiles cannot stall the step for the others.
"""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from cluster.grammar_worker import GrammarCompileWorker
from request.errors import RequestError
from request.structured_outputs import StructuredOutputsParams

if TYPE_CHECKING:
    import llguidance

# Decision: llguidance is imported where a grammar is compiled or a mask filled, never at module load, so
# the engine (and `from raytp import LLM`) runs where it is not installed (a bare GPU box) until a request
# asks for structured output.

_CACHE_SIZE = 256  # compiled grammars kept (LRU); a template matcher is a few hundred KiB at most
# Hostile specs meet llguidance's default parser limits (measured on SmolLM2's tokenizer): a 100k-value enum
# exceeds the initial lexer fuel and is refused in ~0.3 s, 200 levels of nested objects hit the schema
# parser's recursion limit in ~2 ms; per-step lexer fuel and Earley items cap each mask at a few ms.


class GrammarMatcher:
    """One sample's matcher (scheduler.constraint.TokenConstraint over an llguidance LLMatcher).

    With a `trigger` (StructuredOutputsParams.start_after) it starts dormant: it allows every token and
    watches the decoded output for the trigger, then constrains what follows (the reasoning of a
    `<think>` model stays free, its answer follows the grammar).
    """

    def __init__(
        self, matcher: llguidance.LLMatcher, tokenizer: llguidance.LLTokenizer, trigger: bytes | None = None
    ) -> None:
        self.matcher = matcher
        self._tokenizer = tokenizer
        self._trigger = trigger
        self._tail = b""  # the end of the dormant output, long enough to hold the trigger

    @property
    def active(self) -> bool:
        return self._trigger is None

    def accept(self, token_id: int) -> bool:
        if self._trigger is not None:
            self._tail = (self._tail + self._tokenizer.decode_bytes([token_id]))[-4 * len(self._trigger) :]
            if self._trigger in self._tail:
                self._trigger = None
            return True
        return bool(self.matcher.consume_token(token_id))

    def fork(self) -> GrammarMatcher:
        twin = GrammarMatcher(self.matcher.deep_copy(), self._tokenizer, self._trigger)
        twin._tail = self._tail
        return twin

    @property
    def is_terminated(self) -> bool:
        return self.active and bool(self.matcher.is_stopped())

    @property
    def error(self) -> str | None:
        return self.matcher.get_error() if self.matcher.is_error() else None


class StructuredOutputManager:
    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        """`vocab_size`: the width of the model's logits (masks cover it; ids past the tokenizer's are never
        allowed). The llguidance tokenizer is built on first use (~0.3 s), on the compile thread."""
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="raytp-grammar")
        self._executor: llguidance.LLExecutor | None = None
        self._worker: GrammarCompileWorker | None = None  # started by the first compile
        self._cache: OrderedDict[str, Future[llguidance.LLMatcher]] = OrderedDict()
        self._lock = threading.Lock()  # the cache is reached from the event loop and from offline callers

    # ------------------------------------------------------------------ compile
    def compile(self, spec: StructuredOutputsParams) -> Future[llguidance.LLMatcher]:
        """The spec's template matcher, compiling on the grammar thread unless cached. A failed compile is
        not cached (its future raises RequestError)."""
        key = spec.key
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None and not (fut.done() and fut.exception() is not None):
                self._cache.move_to_end(key)
                return fut
            fut = self._pool.submit(self._compile, spec)
            self._cache[key] = fut
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return fut

    async def prepare(self, spec: StructuredOutputsParams) -> None:
        """Wait (without blocking the event loop) until the spec is compiled; raises RequestError if it fails."""
        await asyncio.wrap_future(self.compile(spec))

    def matcher(self, spec: StructuredOutputsParams) -> GrammarMatcher:
        """A fresh matcher for one request (blocks until compiled: offline callers; the server awaits
        `prepare` first, so this finds the compiled grammar)."""
        template = self.compile(spec).result()  # also builds the tokenizer, on the compile thread
        assert self._ll_tokenizer is not None
        trigger = spec.start_after.encode() if spec.start_after else None
        return GrammarMatcher(template.deep_copy(), self._ll_tokenizer, trigger)

    def _compile(self, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
        import llguidance

        worker = self._compile_worker()
        worker.start()  # the child builds its tokenizer while this thread builds the controller's
        grammar = worker.compile(spec)  # RequestError if it does not compile, or crashes the child
        matcher = llguidance.LLMatcher(
            self._tokenizer(),
            grammar,
            log_level=0,
            limits=llguidance.LLParserLimits(),
        )
        if matcher.is_error():
            raise RequestError(
                f"{spec.field}: the {spec.kind} constraint cannot be compiled: {matcher.get_error()}", spec.field
            )
        return matcher

    def _compile_worker(self) -> GrammarCompileWorker:
        if self._worker is None:  # only the compile thread makes it
            backend = self._hf_tokenizer.backend_tokenizer
            self._worker = GrammarCompileWorker(backend.to_str(), self.vocab_size, self._eos)
        return self._worker

    @property
    def compile_worker_pid(self) -> int | None:
        return self._worker.pid if self._worker is not None else None

    @property
    def compile_worker_restarts(self) -> int:
        """Compile workers replaced after a crash or a timeout (each one a spec refused with a 400)."""
        return self._worker.restarts if self._worker is not None else 0

    def _tokenizer(self) -> llguidance.LLTokenizer:
        if self._ll_tokenizer is None:  # only the compile thread builds it
            import llguidance

            backend = self._hf_tokenizer.backend_tokenizer
            self._ll_tokenizer = llguidance.LLTokenizer(backend.to_str(), n_vocab=self.vocab_size, eos_token=self._eos)
        return self._ll_tokenizer

    # ------------------------------------------------------------------ each step
    def fill_bitmask(self, matchers: list[GrammarMatcher]) -> np.ndarray:
        """int32 [len(matchers), ceil(vocab / 32)]: row i packs the tokens matcher i allows next (the
        rows computed in parallel by llguidance's own threads)."""
        import llguidance
        import llguidance.numpy as llg_np

        bitmask = llg_np.allocate_token_bitmask(len(matchers), self.vocab_size)  # all ones: dormant rows
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        active = [(m.matcher, i) for i, m in enumerate(matchers) if m.active]
        if active:
            llg_np.fill_next_token_bitmask_par(self._executor, active, bitmask)
        return bitmask

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._worker is not None:
            self._worker.shutdown()
