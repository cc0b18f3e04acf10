"""The offline API on the embedded SmolLM2: sampling, stops, logprobs, n/best_of, bad input.

One engine serves the whole module; after every test all KV blocks must be free again.
"""

from __future__ import annotations

import json

import pytest
import torch

from cluster import LLM, SamplingParams
from cluster.cli import main as cli_main
from tests.cluster.reference import hf_model

pytestmark = pytest.mark.slow

FRANCE = "The capital of France is"  # greedy: " Paris.\n\nThe answer is: 2018-01-22 12:1..."


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(None, max_model_len=1024, block_size=16)


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
    different_seed = (
        llm.generate("Once upon a time", target.clone(seed=99), use_tqdm=False)[0].outputs[0].token_ids
    )
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
    (two,) = llm.generate(
        "Write a haiku:", SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=16), use_tqdm=False
    )
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
    expected = [
        o.outputs[0].token_ids for o in llm.generate([FRANCE, "def add(a, b):"], greedy(16), use_tqdm=False)
    ]
    engine.add_request("ok-1", FRANCE, greedy(16))
    engine.add_request("ok-2", "def add(a, b):", greedy(16))
    engine.step()
    engine.step()
    with pytest.raises(ValueError, match="prompt must not be empty"):
        engine.add_request("bad-1", "", greedy(4))
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("bad-2", {"prompt_token_ids": [5] * 2000}, greedy(4))
    with pytest.raises(ValueError, match="prompt_token_ids"):
        engine.add_request("bad-3", {"prompt_token_ids": [10**9]}, greedy(4))
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate(["fine", "x " * 3000], greedy(4), use_tqdm=False)  # one bad prompt refuses the call
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert [done["ok-1"], done["ok-2"]] == expected


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
    (plain,) = llm.generate(
        {"prompt_token_ids": llm.get_tokenizer().encode(templated)}, greedy(12), use_tqdm=False
    )
    assert chat.outputs[0].token_ids == plain.outputs[0].token_ids
    assert chat.outputs[0].text.strip()


def test_cli_generate(capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli_main(["generate", "--prompt", FRANCE, "--max-tokens", "6", "--json", "--max-model-len", "256"])
    assert rc == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["outputs"][0]["text"].startswith(" Paris.")
