"""The raytp Ray Serve application, as Serve and the Helm chart name it:

    serve run serve_app:app                          # the embedded SmolLM2, one model replica
    serve run serve_config.example.yaml              # import_path: serve_app:build_app, with args
    serve run serve_config.multi.example.yaml        # several models (args.models) and LoRA adapters
    raytp serve [MODEL] --port 8000                  # the same, started with one command

The Serve graph, as `build_app` binds it (raytp/serve/app.py):

    HAProxy (each node's HTTP port) -> OpenAIIngress replicas, one per model replica (Serve balances):
        FastAPI routes (auth, parsing, tokenizer, chat template, response shapes) and the replica's
        engine loop (scheduler, KV blocks, output processing), handing each token to its SSE stream
        through an asyncio queue
            -> placement group of TP worker actors (model shard + KV cache each)

With `split_ingress`, the engine loops move to an `LLMServer` deployment of their own behind
`ingress_replicas` ingress replicas (one Ray message per streamed token between the two). With several
models (`args.models`, serve_config.multi.example.yaml), one ingress deployment routes each request by its
`model` to that model's own `LLMServer:<name>` deployment.

The application lives in `raytp/serve/`, the routes and handlers in `raytp/openai/`; nothing imports
this file.
"""

from raytp.serve.app import build_app

__all__ = ["app", "build_app"]

app = build_app({})
