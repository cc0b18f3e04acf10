"""The `raytp` command line.

raytp generate [--model M] --prompt TEXT [--prompt TEXT ...] [sampling flags] [engine flags]
raytp serve [MODEL] [--host H] [--port P] [--num-replicas N] [--api-key K] [engine flags]
raytp batch -i IN.jsonl -o OUT.jsonl [--error-file ERR.jsonl] [MODEL] [--num-replicas N] [engine flags]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from raytp.cli.args import add_engine_args, engine_config_from_args
from raytp.cli.batch import add_batch_parser
from raytp.cli.serve import add_serve_parser
from request.sampling_params import SamplingParams

# this command's own defaults of the fields a model's generation_config.json may set (greedy, 64 tokens)
_CLI_DEFAULTS: dict[str, Any] = {
    "max_tokens": 64,
    "temperature": 0.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
}


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling (unset: the model's generation_config.json, else the value shown)")
    g.add_argument("--max-tokens", type=int, default=None, help="64")
    g.add_argument("--temperature", type=float, default=None, help="0 = greedy (the default here)")
    g.add_argument("--top-p", type=float, default=None, help="1.0")
    g.add_argument("--top-k", type=int, default=None, help="0 (off)")
    g.add_argument("--min-p", type=float, default=None, help="0.0")
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=None, help="1.0 (off)")
    g.add_argument("--n", type=int, default=1)
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--logprobs", type=int, default=None)


def _sampling_params(args: argparse.Namespace, model_defaults: dict[str, Any] | None = None) -> SamplingParams:
    """The flags given; for those left unset, the model's default (`model_defaults`), else _CLI_DEFAULTS."""
    unset = {**_CLI_DEFAULTS, **(model_defaults or {})}
    chosen = {name: getattr(args, name) if getattr(args, name) is not None else unset[name] for name in _CLI_DEFAULTS}
    return SamplingParams(
        **chosen,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        n=args.n,
        seed=args.sampling_seed,
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
        logprobs=args.logprobs,
    )


def _cmd_generate(args: argparse.Namespace) -> int:
    from raytp.llm import LLM

    _sampling_params(args)  # validate flags before loading anything
    config = engine_config_from_args(args)
    llm = LLM(**{k: v for k, v in vars(config).items()})
    params = _sampling_params(args, llm.llm_engine.generation_defaults)
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params, use_tqdm=False)
    else:
        outputs = llm.generate(list(args.prompt), params, use_tqdm=False)
    for prompt, out in zip(args.prompt, outputs, strict=True):
        if args.json:
            record = {
                "prompt": prompt,
                "outputs": [
                    {"text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason} for c in out.outputs
                ],
            }
            print(json.dumps(record))
        else:
            for c in out.outputs:
                print(f"--- prompt: {prompt!r}\n{c.text}\n[finish_reason={c.finish_reason}, tokens={len(c.token_ids)}]")
    llm.llm_engine.shutdown()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="raytp", description="LLM inference on Ray with a paged KV cache.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate completions offline for a few prompts")
    gen.add_argument("--model", default=None, help="HF dir, .gguf file or hub id (default: embedded SmolLM2)")
    gen.add_argument("--prompt", action="append", required=True, help="prompt text (repeatable)")
    gen.add_argument("--chat", action="store_true", help="treat each prompt as a user message (chat template)")
    gen.add_argument("--json", action="store_true", help="one JSON line per prompt")
    _add_sampling_args(gen)
    add_engine_args(gen)
    gen.set_defaults(func=_cmd_generate)
    add_serve_parser(sub)
    add_batch_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except ValueError as e:
        print(f"raytp: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
