"""JSON mode's grammar, raytp's against vLLM's, token by token (issue 41): at every position of realistic
JSON texts (compact, indented by 2 and 4, nested, escaped), the tokens raytp's `json_object` grammar admits
(llguidance, raytp's whitespace bound and the unbounded alternative) against what vLLM 0.32's admits
(xgrammar's `compile_json_schema('{"type": "object"}', any_whitespace=True)`, vllm/v1/structured_output/
backend_xgrammar.py), on the embedded SmolLM2's tokenizer. Runs in the vLLM venv, which has both libraries:

    bash benchmarks/setup_vllm.sh
    .venv-vllm/bin/python benchmarks/json_mode_masks.py \
        "$(.venv/bin/python -c 'from benchmarks.hf_model import hf_model_dir; print(hf_model_dir())')"
"""

from __future__ import annotations

import collections
import json
import sys
from typing import Any

DOCS: list[Any] = [
    {"name": "Paris", "country": "France", "population": 2148000, "landmarks": ["Eiffel Tower", "Louvre"]},
    {"cat": {"name": "Whiskers", "age": 3, "likes": ["fish", "naps"], "indoor": True, "owner": None}},
    {"person": {"name": 'Alice "Al" Smith', "age": 30.5, "tags": [], "nested": [[1, 2], {"x": -3}]}},
]
PATTERNS = {
    "raytp's bound [ \\t\\n\\r]{0,20}": r"[\x20\x0A\x0D\x09]{0,20}",
    "unbounded [ \\t\\n\\r]*": r"[\x20\x0A\x0D\x09]*",
}


def allowed(bitmask: Any, vocab: int) -> set[int]:
    words = bitmask.view("uint32")
    return {t for t in range(vocab) if (int(words[t // 32]) >> (t % 32)) & 1}


def main() -> None:
    import llguidance
    import llguidance.numpy as lnp
    import xgrammar as xgr
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(sys.argv[1])  # the model's HF directory (the embedded SmolLM2's copy)
    vocab = 49152
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)).compile_json_schema(
        '{"type": "object"}', any_whitespace=True
    )
    ll_tok = llguidance.LLTokenizer(tok.backend_tokenizer.to_str(), n_vocab=vocab, eos_token=[tok.eos_token_id])
    texts = [json.dumps(d, indent=i) for d in DOCS for i in (None, 2, 4)]
    texts += [json.dumps(d, separators=(",", ":")) for d in DOCS]
    for name, pattern in PATTERNS.items():
        options = {"whitespace_flexible": True, "item_separator": ",", "key_separator": ":"}
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            {"type": "object"}, defaults={**options, "whitespace_pattern": pattern}
        )
        differ = total = 0
        only_x: collections.Counter[str] = collections.Counter()
        only_l: collections.Counter[str] = collections.Counter()
        for text in texts:
            xm, lm = xgr.GrammarMatcher(compiled), llguidance.LLMatcher(ll_tok, grammar, log_level=0)
            xb, lb = xgr.allocate_token_bitmask(1, vocab), lnp.allocate_token_bitmask(1, vocab)
            for t in tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]:
                xm.fill_next_token_bitmask(xb)
                lnp.fill_next_token_bitmask(lm, lb, 0)
                x, ll = allowed(xb[0].numpy(), vocab), allowed(lb[0], vocab)
                total += 1
                if x != ll:
                    differ += 1
                    only_x.update(tok.decode([u]) for u in x - ll)
                    only_l.update(tok.decode([u]) for u in ll - x)
                if t == tok.eos_token_id:
                    break
                assert xm.accept_token(t) and lm.consume_token(t), (text, t)
        print(f"{name}: masks differ at {differ} of {total} positions")
        print(f"  admitted by xgrammar only: {sorted(only_x)[:20]}")
        print(f"  admitted by llguidance only: {sorted(only_l)[:20]}")


if __name__ == "__main__":
    main()
