"""The Ray Serve application: an OpenAI-compatible API over the raytp engine.

    args.py      ServeArgs (build_app's arguments) and the environment Serve's processes start with
    replica.py   ModelReplica (one engine loop + admission control) and the LLMServer deployment
    ingress.py   OpenAIIngress: the deployment that serves HTTP (the FastAPI app of raytp/openai/app.py)
    app.py       build_app: the deployment graph

`serve_app.py` at the top of the repository names `build_app` for `serve run` and the Helm chart.
Nothing is imported here: the CLI reads `args` without paying for Ray Serve and FastAPI.
"""
