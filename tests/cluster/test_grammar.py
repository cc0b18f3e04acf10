"""The controller's grammar side on the embedded model's tokenizer, without a model: compile, cache,
refusals (naming the field, quickly for hostile specs), masks, forks and `start_after`."""

from __future__ import annotations

from typing import Any

import pytest

from cluster.structured_output import GrammarMatcher, StructuredOutputManager
from model_exec.source import load_tokenizer, resolve_model
from scheduler.errors import RequestError
from scheduler.structured_outputs import StructuredOutputsParams as Spec


@pytest.fixture(scope="module")
def tok() -> Any:
    return load_tokenizer(resolve_model(None))


@pytest.fixture(scope="module")
def manager(tok: Any) -> StructuredOutputManager:
    return StructuredOutputManager(tok, len(tok), (tok.eos_token_id,))


def allowed(manager: StructuredOutputManager, m: GrammarMatcher) -> set[int]:
    row = manager.fill_bitmask([m])[0]
    return {t for t in range(manager.vocab_size) if (int(row[t // 32]) >> (t % 32)) & 1}


def feed(tok: Any, m: GrammarMatcher, text: str) -> bool:
    return all(m.accept(t) for t in tok.encode(text, add_special_tokens=False))


def test_spec_shape_is_checked_where_it_is_built() -> None:
    with pytest.raises(RequestError) as e:
        Spec(field="response_format")
    assert e.value.param == "response_format"
    with pytest.raises(RequestError):
        Spec(json="{nope", field="guided_json")
    with pytest.raises(RequestError):
        Spec(regex="a", choice=["a"])  # two kinds at once
    assert Spec(json='{"type": "object"}').key == Spec(json={"type": "object"}).key
    assert Spec(json={"type": "object"}).key != Spec(json={"type": "object"}, disable_any_whitespace=True).key


def test_compiling_does_not_block_the_caller(manager: StructuredOutputManager) -> None:
    """The engine loop hands a spec to the grammar thread and goes on (1,024 optional properties take
    ~0.2 s to compile, twice: in the compile worker and then here)."""
    props = {f"p{i}": {"type": "string"} for i in range(1024)}
    future = manager.compile(Spec(json={"type": "object", "properties": props}))
    assert not future.done()
    future.result(timeout=60)


def test_compiles_once_per_spec_and_does_not_cache_failures(manager: StructuredOutputManager) -> None:
    spec = Spec(choice=["alpha", "beta"])
    assert manager.compile(spec) is manager.compile(Spec(choice=["alpha", "beta"]))
    bad = Spec(regex="((", field="guided_regex")
    first = manager.compile(bad)
    with pytest.raises(RequestError) as e:
        first.result()
    assert e.value.param == "guided_regex" and "regex" in e.value.message
    assert manager.compile(bad) is not first


def chain_grammar(rules: int) -> str:
    """A Lark grammar of one chain of rules: 3,000 rules (36 KB, within every bound) overflow llguidance's
    native stack when it builds a matcher (a segfault, measured in-process)."""
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(rules)) + f'r{rules}: "x"\n'


def test_a_grammar_that_crashes_the_compiler_is_refused_and_the_worker_replaced(
    tok: Any, manager: StructuredOutputManager
) -> None:
    """The crash happens in the compile worker: the spec is a RequestError naming its field, the worker is
    replaced, a matcher made before keeps working and the next spec compiles."""
    beside = manager.matcher(Spec(json={"type": "object", "properties": {"a": {"type": "integer"}}}))
    pid = manager.compile_worker_pid
    assert pid is not None
    with pytest.raises(RequestError) as e:
        manager.compile(Spec(grammar=chain_grammar(3000), field="guided_grammar")).result(timeout=60)
    assert e.value.param == "guided_grammar" and "crashed" in e.value.message
    assert manager.compile_worker_pid not in (None, pid)
    assert feed(tok, beside, '{"a": 12}') and beside.is_terminated
    assert feed(tok, manager.matcher(Spec(regex="[0-9]+z")), "42z")


def test_a_compile_past_the_timeout_is_refused(tok: Any) -> None:
    """A child that does not answer in time is killed and replaced (a 1 ms timeout stands in for a hang)."""
    manager = StructuredOutputManager(tok, len(tok), (tok.eos_token_id,))
    try:
        manager.matcher(Spec(regex="a"))  # the worker is up, its tokenizer built
        assert manager._worker is not None
        manager._worker.timeout_s = 0.001
        with pytest.raises(RequestError) as e:
            manager.compile(Spec(choice=[f"c{i}" for i in range(4000)], field="guided_choice")).result(timeout=60)
        assert e.value.param == "guided_choice" and "within" in e.value.message
        assert manager._worker.restarts == 1
    finally:
        manager.shutdown()


def test_masks_follow_the_grammar_and_forks_are_independent(tok: Any, manager: StructuredOutputManager) -> None:
    m = manager.matcher(Spec(choice=["yes", "no"]))
    first = {tok.decode([t]) for t in allowed(manager, m)}
    assert {"y", "n", "yes", "no"} <= first and all(s in ("y", "n", "ye", "yes", "no") for s in first)
    twin = m.fork()
    assert feed(tok, m, "yes") and m.is_terminated
    assert not twin.is_terminated and feed(tok, twin, "no") and twin.is_terminated
    broken = manager.matcher(Spec(choice=["yes", "no"]))
    assert not broken.accept(tok.encode("x", add_special_tokens=False)[0]) and broken.error


def test_json_whitespace_is_bounded_unless_disabled(tok: Any, manager: StructuredOutputManager) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert feed(tok, manager.matcher(Spec(json=schema)), '{\n  "a": 1\n}')
    assert not feed(tok, manager.matcher(Spec(json=schema)), "{" + " " * 40 + '"a": 1}')
    assert not feed(tok, manager.matcher(Spec(json=schema, disable_any_whitespace=True)), '{"a": 1}')
    assert feed(tok, manager.matcher(Spec(json=schema, disable_any_whitespace=True)), '{"a":1}')


def test_start_after_leaves_the_reasoning_free(tok: Any, manager: StructuredOutputManager) -> None:
    m = manager.matcher(Spec(choice=["yes", "no"], start_after="</think>"))
    assert not m.active and len(allowed(manager, m)) == manager.vocab_size
    assert feed(tok, m, "Let me think: anything goes here.") and not m.active
    assert feed(tok, m, "</think>") and m.active
    assert {tok.decode([t]) for t in allowed(manager, m)} <= {"y", "n", "ye", "yes", "no"}
    assert feed(tok, m, "no") and m.is_terminated
