"""A random Llama of SmolLM2-135M's size written as a Q4_K_M-style GGUF, for timing the Q4_K / Q6_K kernels with
`benchmarks/quantized.py --model OUT/gguf/model.gguf --skip-ppl` (its weights are random: ms/token and
tokens/s mean what they say, perplexity does not).

    PYTHONPATH=. python benchmarks/kquant_model.py /tmp/kquant_model [--mix q4_k_m|q4_k|q6_k]

SmolLM2-135M itself cannot be made a K-quant file: its width 576 is not a multiple of the 256-weight
super-block (llama.cpp's quantizer falls back to Q5_0/Q8_0 for such rows), so this model is 512 wide with
SmolLM2's depth (30 layers), MLP width (1536), vocabulary (49152, tied) and 8 q / 4 kv heads of 64: 122M
parameters. The mix follows llama.cpp's Q4_K_M (Q6_K for token_embd, attn_v and ffn_down, Q4_K for the rest;
llama.cpp alternates some layers, not done here); `q4_k` and `q6_k` put every matrix in one type. The blocks
come from the tests' numpy K-quant writer (tests/helpers/kquants.py: the `gguf` package cannot quantize these
types), the byte tokenizer from tests/helpers/tiny_models.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MIXES = {
    "q4_k_m": {"token_embd": 14, "attn_v": 14, "ffn_down": 14, "": 12},
    "q4_k": {"": 12},
    "q6_k": {"": 14},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="a folder: the HF model goes to OUT/tiny-llama, the GGUF to OUT/gguf/model.gguf")
    ap.add_argument("--mix", choices=sorted(MIXES), default="q4_k_m")
    args = ap.parse_args()

    import gguf

    from tests.helpers.tiny_gguf import write_tiny_gguf
    from tests.helpers.tiny_models import make_tiny_llama

    out = Path(args.out)
    hf = make_tiny_llama(
        out,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=49152,
        max_position_embeddings=2048,
        initializer_range=0.02,
    )
    types = {key: gguf.GGMLQuantizationType(q) for key, q in MIXES[args.mix].items()}
    folder = write_tiny_gguf(hf, out / "gguf", quant_types=types)
    print(Path(folder) / "model.gguf")


if __name__ == "__main__":
    main()
