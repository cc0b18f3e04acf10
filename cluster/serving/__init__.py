"""The OpenAI-compatible HTTP service on Ray Serve.

    ingress.py      FastAPI routes (the `OpenAIIngress` deployment): auth, body parsing, dispatch
    completions.py  /v1/completions: prompts -> engine requests -> a response or an SSE stream
    chat.py         /v1/chat/completions: messages -> chat template -> one engine request
    generation.py   one engine request seen from the ingress: deltas -> text updates; abort on exit
    text_stream.py  per-sequence incremental detokenization, stop strings, hold-back
    context.py      what the handlers of one ingress replica share (tokenizer, model limits, SSE framing)
    sampling.py     OpenAI fields -> SamplingParams; prompt and max_tokens checks
    logprobs.py     token logprobs in the completions and chat shapes
    protocol.py     OpenAI request/response schemas (pydantic: the HTTP boundary only)
    errors.py       OpenAI-shaped errors and the status each failure maps to
    server.py       the `LLMServer` deployment: one EngineController per model replica
    builder.py      `build_app(args)` for `serve run` / Serve config YAML
    launcher.py     `raytp serve`

Request path: proxy -> OpenAIIngress (tokenize) -> LLMServer replica -> its EngineController
(stream of token-id deltas) -> back to the ingress (detokenize, stop strings) -> client.
`serve_app.py` at the top level is the entry point; nothing in the engine imports this package.
"""
