"""The Ray Serve application: an OpenAI-compatible API over the raytp engine.

    args.py           ServeArgs / ModelArgs (build_app's arguments) and the environment Serve's processes start with
    replica.py        ModelReplica (one engine loop + admission control + its adapters) and the LLMServer deployment
    ingress.py        OpenAIIngress: the deployment that serves HTTP (the FastAPI app of raytp/openai/app.py)
    lora_registry.py  LoRARegistry: the application's adapter table, with runtime LoRA updating
    lora_sync.py      LoRASync: each replica's copy of that table, kept in step
    lora_admin.py     what the runtime LoRA routes do to the registry and the engines
    app.py            build_app: the deployment graph (one model, or several)
    haproxy_env.py    the server's private HAProxy: its directory, environment and errorfiles
    haproxy_shim.py   the launcher Serve runs as HAProxy (dies with its parent, raytp's error answers)
    port_guard.py     claiming the HTTP port before Serve starts (and naming who holds it)

`serve_app.py` at the top of the repository names `build_app` for `serve run` and the Helm chart.
Nothing is imported here: the CLI reads `args` without paying for Ray Serve and FastAPI.
"""
