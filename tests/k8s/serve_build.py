"""Build a Serve config's application the way Serve's controller does, in a fresh process, and report
what it built: `python -m tests.k8s.serve_build < config.json` prints JSON.

A fresh process, so "no Ray was started and no model was loaded" is a fact about this build alone,
whatever other tests in the same pytest run left initialised. The build is the controller's own two
calls (import_attr, call_user_app_builder_with_args_if_necessary) then Serve's flattening into
deployments; the model would be loaded only by the model replicas (and their workers) on a running cluster.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any


def build(config: dict[str, Any]) -> dict[str, Any]:
    import ray
    from ray._common.utils import import_attr
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    from ray.serve._private.build_app import build_app
    from ray.serve.handle import DeploymentHandle

    from cluster.config import EngineConfig
    from raytp.serve.args import ModelArgs, ServeArgs

    def engine_configs(init_args: tuple[Any, ...]) -> list[EngineConfig]:
        """The EngineConfig of the model replica a deployment hosts: an LLMServer's (its ModelArgs), or the
        ingress's when it is bound to no LLMServer handles (the app's ServeArgs, one model; a split ingress
        only loads tokenizers)."""
        handles = [a for a in init_args if isinstance(a, DeploymentHandle)]
        handles += [h for a in init_args if isinstance(a, dict) for h in a.values() if isinstance(h, DeploymentHandle)]
        models = [a for a in init_args if isinstance(a, ModelArgs)]
        if models:
            return [m.engine for m in models]
        if handles:
            return []
        return [a.model.engine for a in init_args if isinstance(a, ServeArgs)]

    app_config = config["applications"][0]
    app = call_user_app_builder_with_args_if_necessary(import_attr(app_config["import_path"]), app_config["args"])
    built = build_app(app, name=app_config["name"], route_prefix=app_config["route_prefix"])
    deployments: dict[str, Any] = {}
    engines = []
    for d in built.deployments:
        autoscaling = d._deployment_config.autoscaling_config
        deployments[d.name] = {
            "num_replicas": d.num_replicas,
            "autoscaling": None if autoscaling is None else [autoscaling.min_replicas, autoscaling.max_replicas],
            "binds_engine": bool(engine_configs(d.init_args)),
            "served_names": [m.name for m in d.init_args if isinstance(m, ModelArgs)],
        }
        engines += [dataclasses.asdict(c) for c in engine_configs(d.init_args)]
    return {
        "deployments": deployments,
        "engine_configs": engines,
        "ray_initialized": ray.is_initialized(),
        # A model's architecture code is imported only when its config or weights are read.
        "model_code_imported": sorted(
            m
            for m in sys.modules
            if m.startswith("transformers.models.") and not m.startswith("transformers.models.auto")
        ),
    }


if __name__ == "__main__":
    json.dump(build(json.load(sys.stdin)), sys.stdout)
