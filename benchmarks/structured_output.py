"""What structured outputs cost on this machine (a benchmark, not a test; run nothing else meanwhile).

    python -m benchmarks.structured_output [--rows 64] [--rounds 5] [--steps 20]
    python -m benchmarks.structured_output --compare-libraries   # llguidance vs xgrammar (if installed)

1. Step time: one engine (the embedded SmolLM2, in-process) decodes `rows` requests that share a prompt,
   once free and once each under a JSON schema; the median decode-step time of each round, rounds
   interleaved, and their medians. The schema's string field has a minimum length, so every row is still
   decoding during the timed steps in both cases.
2. TTFT with a cold grammar cache (a schema never seen: compile + first token), with a warm one (the same
   schema again), and without a constraint, each the median of `rounds` single requests.
3. --compare-libraries: compile time and per-token mask time of llguidance and xgrammar on the same
   tokenizer and schema (the decision recorded in cluster/structured_output.py).
4. --compile-cost: what the compile worker (cluster/grammar_worker.py) costs per uncached spec: the
   manager's compile (in the worker, then the controller's matcher from its grammar) against the same
   compile done in-process only (what raytp did before), interleaved, medians of `rounds` fresh schemas;
   and a repeat of a compiled spec (the cache: no compile at all).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from raytp import LLM, SamplingParams, StructuredOutputsParams

PROMPT = "Write a JSON object describing a person with a long biography:"
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "bio": {"type": "string", "minLength": 400},
    },
    "required": ["bio", "name", "age"],
}


def decode_step_ms(llm: LLM, rows: int, steps: int, constrained: bool) -> float:
    """Median ms of `steps` decode steps with `rows` live requests (after the prefill step)."""
    engine = llm.llm_engine
    spec = StructuredOutputsParams(json=SCHEMA) if constrained else None
    params = SamplingParams(temperature=1.0, max_tokens=steps + 2, ignore_eos=True, structured_outputs=spec)
    for i in range(rows):
        engine.add_request(f"r{i}", PROMPT, params.clone(seed=i))
    engine.step()  # every prompt in one chunk, plus the first token
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        deltas = engine.step()
        times.append((time.perf_counter() - start) * 1e3)
        assert len(deltas) == rows, "a row finished early: the timed steps would not be comparable"
    while engine.has_unfinished_requests():
        engine.step()
    return statistics.median(times)


def ttft_ms(llm: LLM, spec: StructuredOutputsParams | None) -> float:
    engine = llm.llm_engine
    start = time.perf_counter()
    engine.add_request("ttft", PROMPT, SamplingParams(temperature=0.0, max_tokens=1, structured_outputs=spec))
    while not any(d.samples and d.samples[0].token_ids for d in engine.step()):
        pass
    elapsed = (time.perf_counter() - start) * 1e3
    while engine.has_unfinished_requests():
        engine.step()
    return elapsed


def unique_schema(i: int) -> StructuredOutputsParams:
    """A schema no earlier request used (so its grammar is not in the cache)."""
    schema = json.loads(json.dumps(SCHEMA))
    schema["properties"][f"field_{i}_{time.monotonic_ns()}"] = {"type": "boolean"}
    return StructuredOutputsParams(json=schema)


def compare_libraries() -> None:
    from model_exec.source import load_tokenizer, resolve_model

    tok = load_tokenizer(resolve_model(None))
    vocab = len(tok)
    doc = json.dumps({"name": "Alice", "age": 31, "bio": "x" * 20}, separators=(",", ":"))
    ids = tok.encode(doc, add_special_tokens=False)
    schema = dict(SCHEMA, properties=dict(SCHEMA["properties"], bio={"type": "string"}))

    import llguidance
    import llguidance.numpy as lnp

    start = time.perf_counter()
    lt = llguidance.LLTokenizer(tok.backend_tokenizer.to_str(), n_vocab=vocab, eos_token=tok.eos_token_id)
    setup = time.perf_counter() - start
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
    start = time.perf_counter()
    m = llguidance.LLMatcher(lt, grammar)
    compile_s = time.perf_counter() - start
    bitmask = lnp.allocate_token_bitmask(1, vocab)
    masks = []
    for t in ids:
        start = time.perf_counter()
        lnp.fill_next_token_bitmask(m, bitmask, 0)
        masks.append(time.perf_counter() - start)
        assert m.consume_token(t), m.get_error()
    print(
        f"llguidance {llguidance.get_version() if hasattr(llguidance, 'get_version') else ''}: tokenizer setup "
        f"{setup * 1e3:.0f} ms, compile {compile_s * 1e3:.1f} ms, mask p50 {statistics.median(masks) * 1e6:.0f} us, "
        f"max {max(masks) * 1e6:.0f} us ({len(ids)} tokens); imports torch: no"
    )
    try:
        import xgrammar as xgr
    except ImportError:
        print("xgrammar: not installed (pip install xgrammar; it requires torch and triton)")
        return
    start = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    setup = time.perf_counter() - start
    start = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"))
    compile_s = time.perf_counter() - start
    matcher = xgr.GrammarMatcher(compiled)
    xbitmask = xgr.allocate_token_bitmask(1, vocab)
    masks = []
    for t in ids:
        start = time.perf_counter()
        matcher.fill_next_token_bitmask(xbitmask, 0)
        masks.append(time.perf_counter() - start)
        assert matcher.accept_token(t)
    print(
        f"xgrammar {xgr.__version__}: tokenizer setup {setup * 1e3:.0f} ms, compile {compile_s * 1e3:.1f} ms, "
        f"mask p50 {statistics.median(masks) * 1e6:.0f} us, max {max(masks) * 1e6:.0f} us; imports torch: yes"
    )


def compile_cost(rounds: int) -> None:
    import llguidance

    from cluster.grammars import to_grammar
    from cluster.structured_output import StructuredOutputManager
    from model_exec.source import load_tokenizer, resolve_model

    tok = load_tokenizer(resolve_model(None))
    manager = StructuredOutputManager(tok, len(tok), (tok.eos_token_id,))
    manager.matcher(StructuredOutputsParams(regex="warm"))  # the worker and both tokenizers are up
    ll_tok = manager._tokenizer()
    worker, inproc, cached = [], [], []
    for i in range(rounds):
        spec = unique_schema(1000 + 2 * i)
        start = time.perf_counter()
        manager.matcher(spec)
        worker.append(time.perf_counter() - start)
        start = time.perf_counter()
        manager.matcher(spec)
        cached.append(time.perf_counter() - start)
        other = unique_schema(1001 + 2 * i)
        start = time.perf_counter()
        llguidance.LLMatcher(ll_tok, to_grammar(other), log_level=0, limits=llguidance.LLParserLimits())
        inproc.append(time.perf_counter() - start)
    manager.shutdown()
    w, p, c = (statistics.median(x) * 1e3 for x in (worker, inproc, cached))
    print(
        f"compile, {rounds} fresh JSON schemas: in-process only {p:.1f} ms, compile worker + controller "
        f"matcher {w:.1f} ms ({w - p:+.1f} ms); a cached spec {c:.2f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--compare-libraries", action="store_true")
    parser.add_argument("--compile-cost", action="store_true")
    args = parser.parse_args()
    if args.compile_cost:
        compile_cost(args.rounds)
        return
    if args.compare_libraries:
        compare_libraries()
        return
    llm = LLM(None, max_model_len=1024, max_num_seqs=max(256, args.rows), max_num_batched_tokens=4096)
    decode_step_ms(llm, args.rows, 3, constrained=True)  # warm-up: kernels, the grammar tokenizer, the cache
    free, constrained = [], []
    for _ in range(args.rounds):
        free.append(decode_step_ms(llm, args.rows, args.steps, constrained=False))
        constrained.append(decode_step_ms(llm, args.rows, args.steps, constrained=True))
    f, c = statistics.median(free), statistics.median(constrained)
    print(
        f"decode step, {args.rows} rows: free {f:.1f} ms, JSON schema {c:.1f} ms -> {c / f:.3f}x "
        f"({(c / f - 1) * 100:+.1f}%)"
    )
    print(f"  per round free: {[round(x, 1) for x in free]}, constrained: {[round(x, 1) for x in constrained]}")
    cold, warm, none = [], [], []
    for i in range(args.rounds):
        none.append(ttft_ms(llm, None))
        spec = unique_schema(i)
        cold.append(ttft_ms(llm, spec))
        warm.append(ttft_ms(llm, spec))
    print(
        f"TTFT, one request: no constraint {statistics.median(none):.1f} ms, cold grammar cache "
        f"{statistics.median(cold):.1f} ms, warm {statistics.median(warm):.1f} ms"
    )


if __name__ == "__main__":
    main()
