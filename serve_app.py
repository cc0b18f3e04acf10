"""The raytp Ray Serve application: an OpenAI-compatible API over the raytp engine.

    serve run serve_app:app                          # the embedded SmolLM2, one model replica
    serve run serve_config.yaml                      # import_path: serve_app:build_app, with args
    raytp serve [MODEL] --port 8000                  # the same, started with one command

The application lives in `cluster/serving/`; this module only names its entry points.
"""

from cluster.serving.builder import build_app

app = build_app({})

__all__ = ["app", "build_app"]
