"""The offline API on the embedded SmolLM2: sampling, stops, logprobs, n/best_of, bad input.

One engine serves the whole module; after every test all KV blocks must be free again.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import torch

from cluster.outputs import RequestDelta, RequestOutput, RequestOutputBuilder
from raytp import LLM, RequestError, SamplingParams
from raytp.cli.main import main as cli_main
from tests.cluster.reference import hf_model

pytestmark = pytest.mark.slow

FRANCE = "The capital of France is"  # greedy: " Paris.\n\nThe answer is: 2018-01-22 12:1..."


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    # quantization="none": the logprob tests compare with HF's fp32 dequantised load of the same GGUF at 1e-4;
    # the kept-quantized path (int8 activations) has its own tests (tests/model_exec/test_gguf_quantized.py)
    llm = LLM(None, max_model_len=1024, block_size=16, quantization="none")
    yield llm
    llm.llm_engine.shutdown()  # its KV pool (GiBs) would otherwise outlive the module in the test process


@pytest.fixture(autouse=True)
def no_leaks(llm: LLM):
    yield
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    bm = engine.block_manager
    bm.check_invariants()
    assert bm.num_free_device_blocks == bm.num_device_blocks, "KV blocks leaked"


def greedy(max_tokens: int = 24, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)  # type: ignore[arg-type]


def test_greedy_text_and_finish_reason(llm: LLM) -> None:
    (out,) = llm.generate(FRANCE, greedy(8), use_tqdm=False)
    c = out.outputs[0]
    assert c.text.startswith(" Paris.")
    assert c.finish_reason == "length" and len(c.token_ids) == 8
    assert out.prompt == FRANCE and out.prompt_token_ids == llm.get_tokenizer().encode(FRANCE)
    assert c.text == llm.get_tokenizer().decode(c.token_ids, skip_special_tokens=True)


def test_stop_strings_end_and_trim(llm: LLM) -> None:
    outs = llm.generate(
        [FRANCE] * 3,
        [
            greedy(stop=["\n\n"]),
            greedy(stop=["\n\n"], include_stop_str_in_output=True),
            greedy(stop=["answer", "Paris"]),  # the earliest match wins
        ],
        use_tqdm=False,
    )
    a, b, c = (o.outputs[0] for o in outs)
    assert (a.text, a.finish_reason, a.stop_reason) == (" Paris.", "stop", "\n\n")
    assert b.text == " Paris.\n\n"
    assert (c.text, c.stop_reason) == (" ", "Paris")


def test_stop_token_ids_and_min_tokens(llm: LLM) -> None:
    ids = llm.generate(FRANCE, greedy(12), use_tqdm=False)[0].outputs[0].token_ids
    k = next(i for i in range(3, len(ids)) if ids[i] not in ids[:i])  # a token first seen at position k
    (stopped,) = llm.generate(FRANCE, greedy(12, stop_token_ids=[ids[k]]), use_tqdm=False)
    s = stopped.outputs[0]
    assert s.token_ids == ids[: k + 1] and s.finish_reason == "stop" and s.stop_reason == ids[k]
    # min_tokens masks stop tokens: the first greedy token can no longer end the request at step 1
    (m,) = llm.generate(
        FRANCE,
        SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[ids[0]], min_tokens=5),
        use_tqdm=False,
    )
    assert len(m.outputs[0].token_ids) >= 5 and m.outputs[0].token_ids[0] != ids[0]


def test_seeded_sampling_is_independent_of_the_batch(llm: LLM) -> None:
    target = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=20)
    others = [
        ("Tell me a story about a cat", SamplingParams(temperature=1.0, max_tokens=25)),
        ("1, 2, 3,", greedy(10)),
        (
            "Write a poem about the sea",
            SamplingParams(temperature=0.7, seed=7, max_tokens=30, presence_penalty=0.5),
        ),
    ]
    alone = llm.generate("Once upon a time", target, use_tqdm=False)[0].outputs[0].token_ids
    again = llm.generate("Once upon a time", target, use_tqdm=False)[0].outputs[0].token_ids
    mixed = (
        llm.generate(
            [p for p, _ in others] + ["Once upon a time"], [sp for _, sp in others] + [target], use_tqdm=False
        )[-1]
        .outputs[0]
        .token_ids
    )
    reordered = (
        llm.generate(
            ["Once upon a time"] + [p for p, _ in reversed(others)],
            [target] + [sp for _, sp in reversed(others)],
            use_tqdm=False,
        )[0]
        .outputs[0]
        .token_ids
    )
    assert alone == again == mixed == reordered
    different_seed = llm.generate("Once upon a time", target.clone(seed=99), use_tqdm=False)[0].outputs[0].token_ids
    assert different_seed != alone


def test_logprobs_match_hf_log_softmax(llm: LLM) -> None:
    (out,) = llm.generate(FRANCE, greedy(10, logprobs=5, prompt_logprobs=3), use_tqdm=False)
    c = out.outputs[0]
    ids = out.prompt_token_ids + c.token_ids
    with torch.inference_mode():
        ref = torch.log_softmax(hf_model(None)(torch.tensor([ids])).logits[0].float(), dim=-1)
    n_prompt = len(out.prompt_token_ids)
    assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids)
    for i, (tok, entry) in enumerate(zip(c.token_ids, c.logprobs, strict=True)):
        row = ref[n_prompt - 1 + i]
        assert abs(entry[tok].logprob - float(row[tok])) < 1e-4
        assert entry[tok].rank == 1  # greedy picks the most likely token
        top5 = set(row.topk(5).indices.tolist())
        assert top5 <= set(entry), "the top-5 tokens must all be reported"
        for t, lp in entry.items():
            assert abs(lp.logprob - float(row[t])) < 1e-4
    plp = out.prompt_logprobs
    assert plp is not None and len(plp) == n_prompt and plp[0] is None
    for j in range(1, n_prompt):
        entry = plp[j]
        assert entry is not None and ids[j] in entry
        assert abs(entry[ids[j]].logprob - float(ref[j - 1, ids[j]])) < 1e-4
        assert entry[ids[j]].rank == int((ref[j - 1] > ref[j - 1, ids[j]]).sum()) + 1
    assert c.cumulative_logprob == pytest.approx(
        sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs, strict=True))
    )


def test_n_and_best_of(llm: LLM) -> None:
    (two,) = llm.generate("Write a haiku:", SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=16), use_tqdm=False)
    assert len(two.outputs) == 2 and two.outputs[0].token_ids != two.outputs[1].token_ids
    params = SamplingParams(n=2, best_of=4, temperature=1.0, seed=3, max_tokens=16, logprobs=0)
    (best,) = llm.generate("Write a haiku:", params, use_tqdm=False)
    assert [o.index for o in best.outputs] == [0, 1]
    cums = [o.cumulative_logprob for o in best.outputs]
    assert cums == sorted(cums, reverse=True)


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("max_tokens", dict(max_tokens=0)),
        ("temperature", dict(temperature=-0.5)),
        ("top_p", dict(top_p=0.0)),
        ("top_p", dict(top_p=1.5)),
        ("n", dict(n=0)),
        ("best_of", dict(n=3, best_of=2, temperature=1.0)),
    ],
)
def test_bad_sampling_params_name_the_field(field: str, kwargs: dict) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_prompts_raise_and_the_engine_keeps_serving(llm: LLM) -> None:
    engine = llm.llm_engine
    expected = [o.outputs[0].token_ids for o in llm.generate([FRANCE, "def add(a, b):"], greedy(16), use_tqdm=False)]
    engine.add_request("ok-1", FRANCE, greedy(16))
    engine.add_request("ok-2", "def add(a, b):", greedy(16))
    early = engine.step() + engine.step()  # in flight while the bad requests arrive
    bad: list[tuple[object, SamplingParams, str, str]] = [
        ("", greedy(4), "prompt", "must not be empty"),
        ({"prompt_token_ids": [5] * 2000}, greedy(4), "prompt", "maximum context length"),
        ({"prompt_token_ids": [10**9]}, greedy(4), "prompt", "vocabulary"),
        (FRANCE, greedy(4, stop_token_ids=[10**9]), "stop_token_ids", "vocabulary"),
        (FRANCE, greedy(4, logit_bias={10**9: 1.0}), "logit_bias", "vocabulary"),
        (FRANCE, SamplingParams(n=300, temperature=1.0), "n", "max_num_seqs"),
    ]
    for i, (prompt, params, param, message) in enumerate(bad):
        with pytest.raises(RequestError, match=message) as info:
            engine.add_request(f"bad-{i}", prompt, params)  # type: ignore[arg-type]
        assert info.value.param == param
    with pytest.raises(RequestError, match="maximum context length"):
        llm.generate(["fine", "x " * 3000], greedy(4), use_tqdm=False)  # one bad prompt refuses the call
    done = drain(engine, early)
    assert [done["ok-1"].outputs[0].token_ids, done["ok-2"].outputs[0].token_ids] == expected


def drain(engine: object, earlier: list[RequestDelta]) -> dict[str, RequestOutput]:
    """Step the engine until idle; every request's output, folded from its deltas (`earlier` ones first)."""
    builders: dict[str, RequestOutputBuilder] = {}
    deltas = list(earlier)
    while deltas or engine.has_unfinished_requests():  # type: ignore[attr-defined]
        for delta in deltas:
            builders.setdefault(delta.request_id, RequestOutputBuilder(delta.request_id)).add(delta)
        deltas = engine.step() if engine.has_unfinished_requests() else []  # type: ignore[attr-defined]
    return {rid: b.build() for rid, b in builders.items()}


def test_bad_engine_configs_name_the_field() -> None:
    with pytest.raises(ValueError, match="attention_backend"):
        LLM(None, attention_backend="nope")
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(None, tensor_parallel_size=2)  # SmolLM2 has 9 query and 3 KV heads


def test_prompt_forms_and_order(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    ids = tok.encode("1, 2, 3,")
    outs = llm.generate(
        [FRANCE, {"prompt_token_ids": ids}, {"prompt": "def add(a, b):"}],
        [greedy(4), greedy(5), greedy(6)],
        use_tqdm=False,
    )
    assert [len(o.outputs[0].token_ids) for o in outs] == [4, 5, 6]
    assert outs[1].prompt_token_ids == ids
    single = llm.generate({"prompt_token_ids": ids}, greedy(5), use_tqdm=False)
    assert single[0].outputs[0].token_ids == outs[1].outputs[0].token_ids


def test_chat_uses_the_template(llm: LLM) -> None:
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    (chat,) = llm.chat(messages, greedy(12), use_tqdm=False)
    templated = llm.get_tokenizer().apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    (plain,) = llm.generate({"prompt_token_ids": llm.get_tokenizer().encode(templated)}, greedy(12), use_tqdm=False)
    assert chat.outputs[0].token_ids == plain.outputs[0].token_ids
    assert chat.outputs[0].text.strip()


def test_cli_generate(capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli_main(["generate", "--prompt", FRANCE, "--max-tokens", "6", "--json", "--max-model-len", "256"])
    assert rc == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["outputs"][0]["text"].startswith(" Paris.")


LONG = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type, oil-based inks and a wooden press adapted from those used for wine. Within fifty "
    "years presses were running in more than two hundred cities across Europe, and the price of books fell "
    "so far that reading spread well beyond monasteries and universities."
)


def test_prompt_logprobs_are_complete_when_the_prefix_cache_hits(llm: LLM) -> None:
    """Regression (issue 7, bug 3): cached prompt positions came back as None. A request that asks for
    prompt logprobs computes its whole prompt; the result equals a cache-off engine's and HF's."""
    bm = llm.llm_engine.block_manager
    llm.generate(LONG, greedy(2), use_tqdm=False)  # the prompt's full blocks enter the prefix cache
    (out,) = llm.generate(LONG, greedy(2, prompt_logprobs=2), use_tqdm=False)
    ids, plp = out.prompt_token_ids, out.prompt_logprobs
    assert len(ids) >= 4 * 16, "several blocks long"
    assert plp is not None and len(plp) == len(ids) and plp[0] is None
    assert all(e is not None and tok in e for e, tok in zip(plp[1:], ids[1:], strict=True))
    off = LLM(
        None, max_model_len=1024, enable_prefix_caching=False, kv_cache_memory_bytes=64 << 20, quantization="none"
    )
    try:
        (ref,) = off.generate(LONG, greedy(2, prompt_logprobs=2), use_tqdm=False)
    finally:
        off.llm_engine.shutdown()
    assert ref.prompt_logprobs is not None
    with torch.inference_mode():
        hf = torch.log_softmax(hf_model(None)(torch.tensor([ids])).logits[0].float(), dim=-1)
    for j in range(1, len(ids)):
        mine, theirs = plp[j], ref.prompt_logprobs[j]
        assert mine is not None and theirs is not None and set(mine) == set(theirs)
        assert abs(mine[ids[j]].logprob - theirs[ids[j]].logprob) < 1e-5
        assert abs(mine[ids[j]].logprob - float(hf[j - 1, ids[j]])) < 1e-4
    hits = bm.prefix_cache_hits
    llm.generate(LONG, greedy(2), use_tqdm=False)  # requests without prompt logprobs still use the cache
    assert bm.prefix_cache_hits > hits


def test_best_of_returns_the_n_most_likely_of_all_generated(llm: LLM) -> None:
    """Regression (issue 7, bug 5): not just sorted, but the top n by cumulative logprob of the best_of
    samples (the same seed draws the same samples whatever n is)."""
    base = dict(temperature=1.0, seed=11, max_tokens=12, logprobs=0, ignore_eos=True)
    (every,) = llm.generate("Write a haiku:", SamplingParams(n=4, best_of=4, **base), use_tqdm=False)  # type: ignore[arg-type]
    (best,) = llm.generate("Write a haiku:", SamplingParams(n=2, best_of=4, **base), use_tqdm=False)  # type: ignore[arg-type]
    assert len({tuple(o.token_ids) for o in every.outputs}) == 4
    ranked = sorted(every.outputs, key=lambda o: o.cumulative_logprob or 0.0, reverse=True)
    assert [o.token_ids for o in best.outputs] == [o.token_ids for o in ranked[:2]]
    assert [o.index for o in best.outputs] == [0, 1]


def test_a_stop_string_frees_its_sample_at_once(llm: LLM) -> None:
    """Regression (issue 7, bug 2): with n=2, the sample a stop string ends holds no KV block from that
    step on, while its sibling keeps generating."""
    engine = llm.llm_engine
    base = dict(n=2, temperature=1.0, seed=5, max_tokens=16, ignore_eos=True)
    (free_run,) = llm.generate(FRANCE, SamplingParams(**base), use_tqdm=False)  # type: ignore[arg-type]
    first, second = (o.text for o in free_run.outputs)
    stop = next(first[:k] for k in range(2, len(first)) if first[:k] not in second)  # in sample 0 only
    group = engine.add_request("stop-frees", FRANCE, SamplingParams(stop=[stop], **base))  # type: ignore[arg-type]
    stopped_seq = None
    while engine.has_unfinished_requests():
        for delta in engine.step():
            for s in delta.samples:
                if s.index == 0 and s.finish_reason == "stop":
                    stopped_seq = next(q for q in group.seqs if q.sample_index == 0)
                    assert stopped_seq.is_finished and not engine.block_manager.has_seq(stopped_seq.seq_id)
                    assert not delta.finished, "its sibling is still running"
    assert stopped_seq is not None
    assert len(stopped_seq.output_token_ids) < 16 and group.seqs[1].output_token_ids == free_run.outputs[1].token_ids
