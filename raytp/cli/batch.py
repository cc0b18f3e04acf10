"""`raytp batch`: an OpenAI batch file through N engine replicas on Ray, resumable, exactly once.

raytp batch -i IN.jsonl -o OUT.jsonl [--error-file ERR.jsonl] [MODEL] [--num-replicas N] [engine flags]
raytp batch -i IN.jsonl -o OUT.jsonl --models-file MODELS.yaml [engine flags]   # rows name their `model`

Runs the same way directly (a local Ray is started), under `ray job submit -- raytp batch ...`
(RAY_ADDRESS names the cluster) and as the Helm chart's RayJob. Rerunning the same command after any
crash resumes from the journal next to the output (`OUT.jsonl.journal`); the status file
`OUT.jsonl.status.json` holds the OpenAI Batch object as it runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from raytp.cli.args import add_config_args, add_engine_args, engine_config_from_args
from raytp.openai.chat_settings import ChatSettings


def add_batch_parser(sub: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = sub.add_parser("batch", help="run an OpenAI batch file (resumable, exactly once)")
    p.add_argument("model", nargs="?", default=None, help="HF dir, .gguf file or hub id (default: embedded SmolLM2)")
    p.add_argument("-i", "--input-file", required=True, help="OpenAI batch JSONL")
    p.add_argument("-o", "--output-file", required=True, help="BatchRequestOutput JSONL (each custom_id once)")
    p.add_argument("--error-file", default=None, help="failed rows go here instead of the output file")
    p.add_argument("--num-replicas", type=int, default=1, help="engine replicas sharing the rows")
    p.add_argument("--max-concurrency", type=int, default=64, help="rows in flight per replica")
    p.add_argument("--served-model-name", default=None, help="the model name bodies may send")
    p.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help="LoRA adapters rows may name as `model` (with --enable-lora): name=path, or vLLM's JSON form",
    )
    p.add_argument(
        "--models-file",
        default=None,
        help="YAML/JSON list of models (`models:` entries of engine settings, served_model_name, num_replicas) "
        "for a file whose rows name several models; the engine flags are each entry's defaults",
    )
    p.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    add_config_args(p.add_argument_group("chat"), ChatSettings)
    add_engine_args(p)
    p.set_defaults(func=cmd_batch)
    return p


def cmd_batch(args: argparse.Namespace) -> int:
    import ray

    from model_exec.lora.peft_config import read_adapter_config
    from raytp.batch.models_file import read_models_file
    from raytp.batch.runner import BatchJob, BatchModel, BatchRefused, run_batch, validate_only
    from raytp.serve.args import LoRAModule
    from request.lora import LoRARequest

    engine = dataclasses.replace(engine_config_from_args(args), model=args.model)
    try:
        if args.models_file is None:
            loras = tuple(LoRAModule.parse(m) for m in args.lora_modules or ())
            models = [BatchModel(engine, args.served_model_name, args.num_replicas, loras)]
        elif args.model is not None or args.served_model_name is not None or args.lora_modules:
            raise ValueError("give the models (and their adapters) either on the command line or in --models-file.")
        else:
            models = read_models_file(args.models_file, engine, args.num_replicas)
        for m in models:  # a bad adapter is refused before Ray or any model starts, naming it
            for a in m.lora_modules:
                read_adapter_config(LoRARequest(a.name, 1, a.path), m.engine.max_lora_rank)
    except (OSError, ValueError) as e:
        print(f"raytp batch: {e}", file=sys.stderr)
        return 2
    first, *more = models
    job = BatchJob(
        input_file=args.input_file,
        output_file=args.output_file,
        error_file=args.error_file,
        engine=first.engine,
        served_model_name=first.served_model_name,
        chat=ChatSettings(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ChatSettings)}),
        num_replicas=first.num_replicas,
        batch_size=args.max_concurrency,
        show_progress=not args.no_progress and sys.stderr.isatty(),
        more_models=tuple(more),
        lora_modules=first.lora_modules,
    )
    try:
        validate_only(job)  # refuse a bad file before Ray or any model starts
    except BatchRefused as e:
        print(f"raytp batch: {e}; nothing was run:", file=sys.stderr)
        for err in e.errors:
            print(json.dumps(err.to_dict()), file=sys.stderr)
        return 2
    ray.init(address=None, log_to_driver=True, configure_logging=False)  # RAY_ADDRESS, if set, wins
    try:
        status = run_batch(job)
    except BatchRefused as e:
        print(f"raytp batch: {e}; nothing was run:", file=sys.stderr)
        for err in e.errors:
            print(json.dumps(err.to_dict()), file=sys.stderr)
        return 2
    counts = status.to_dict()["request_counts"]
    print(f"raytp batch: {status.status}: {json.dumps(counts)} -> {job.output_file}", file=sys.stderr)
    return 0
