"""The in-process road runs where only torch, triton and transformers are installed (a bare GPU box).

`benchmarks/gpu_check.py` runs from a plain copy of the repository on a machine with no Ray, no gguf
and no llguidance. A child Python refuses to import them (tests/helpers/bare_python.py) and generates
with a tiny model through `raytp.LLM` in-process; its greedy tokens must be Hugging Face's on the same
weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from model_exec.source import resolve_model
from tests.helpers.bare_python import ABSENT, run_bare
from tests.helpers.hf_reference import load_hf_reference_model
from tests.helpers.tiny_models import make_tiny_llama

PROMPT = [1, 40, 41, 42, 43]
MAX_TOKENS = 6

_CHILD = """
import json
from raytp import LLM, SamplingParams

llm = LLM(MODEL, distributed_executor_backend="inprocess", device="cpu", attention_backend="torch")
out = llm.generate([PROMPT], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0), use_tqdm=False)
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ABSENT)
print("RESULT " + json.dumps({"tokens": list(out[0].outputs[0].token_ids), "loaded": loaded}))
"""


def test_inprocess_llm_runs_without_ray_gguf_llguidance(tmp_path: Path) -> None:
    model_dir = make_tiny_llama(tmp_path / "tiny")
    setup = f"MODEL = {model_dir!r}\nPROMPT = {PROMPT!r}\nMAX_TOKENS = {MAX_TOKENS}\nABSENT = {ABSENT!r}\n"
    proc = run_bare(setup + _CHILD)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    result = json.loads(line.removeprefix("RESULT "))
    assert result["loaded"] == []

    hf = load_hf_reference_model(resolve_model(model_dir))
    with torch.no_grad():
        ids = hf.generate(torch.tensor([PROMPT]), max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None)
    assert result["tokens"] == ids[0, len(PROMPT) :].tolist()
