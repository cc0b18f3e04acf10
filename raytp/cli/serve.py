"""`raytp serve`: start (or join) Ray, deploy the app, print where it listens, block until a signal.

One model: `raytp serve [MODEL] --flags` (vLLM's form). Several: `raytp serve --config FILE.yaml`, the
Serve config YAML that `serve run` takes (its `serve_app:build_app` application's `args`, with
`models: [...]`) or a YAML of those args alone; flags given beside it set application-level keys (and
model keys every model takes unless its entry sets them). Decision: no repeated per-model flags: vLLM has
no multi-model command line to follow, and a list of models with their own engine settings reads better
as YAML than as positional flag groups.

Shutdown (decision): on Ctrl-C or SIGTERM, a Ray this process started is shut down at once (Serve and
HAProxy with it), so nothing is left running (`_teardown`). On a cluster it joined (RAY_ADDRESS) only the
app is deleted and Serve is left up: other applications may live there.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from types import FrameType
from typing import Any

from cluster.config import EngineConfig
from raytp.cli.args import add_config_args, add_engine_args, engine_fields_of
from raytp.openai.chat_settings import ChatSettings
from raytp.serve.args import ModelArgs, ServeArgs

BUILD_APP = "serve_app:build_app"

APP_NAME = "raytp"


def add_serve_parser(sub: Any) -> None:
    """The `serve` subcommand; flag names follow `vllm serve` where they overlap."""
    p = sub.add_parser("serve", help="serve an OpenAI-compatible API on Ray Serve")
    p.add_argument("model", nargs="?", default=None, help="HF dir, .gguf file or hub id (default: embedded SmolLM2)")
    p.add_argument("--host", default="0.0.0.0", help="address to listen on (default: all interfaces)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--config",
        default=None,
        metavar="FILE.yaml",
        help=f"serve the models a Serve config YAML (import_path {BUILD_APP}) or a YAML of its args lists",
    )
    serving = p.add_argument_group("serving")
    add_config_args(serving, ServeArgs, skip=("models",), unset_is_none=True)
    add_config_args(serving, ModelArgs, skip=("engine", "chat", "lora_modules"), unset_is_none=True)
    serving.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help='LoRA adapters served from the start: name=path, or JSON {"name", "path", "base_model_name"} (vLLM\'s)',
    )
    add_config_args(p.add_argument_group("chat"), ChatSettings, unset_is_none=True)
    add_engine_args(p)
    p.set_defaults(func=_cmd_serve)


def _cmd_serve(args: argparse.Namespace) -> int:
    return run_server(args.host, args.port, serve_args_of(args))


def serve_args_of(args: argparse.Namespace) -> dict[str, Any]:
    """`build_app`'s arguments from the parsed flags and `--config` (serving flags left unset keep the
    defaults of ServeArgs and ModelArgs)."""
    own = {f.name: getattr(args, f.name) for f in dataclasses.fields(ServeArgs) if f.name != "models"}
    own.update(
        {f.name: getattr(args, f.name) for f in dataclasses.fields(ModelArgs) if f.name not in ("engine", "chat")}
    )
    own.update({f.name: getattr(args, f.name) for f in dataclasses.fields(ChatSettings)})
    flags = {k: v for k, v in own.items() if v is not None}
    if getattr(args, "config", None) is None:
        return {**engine_fields_of(args), **flags}
    if args.model is not None:
        raise ValueError("give the model either as MODEL or in --config's models, not both.")
    engine = {k: v for k, v in engine_fields_of(args).items() if v != _ENGINE_DEFAULTS[k]}  # flags given
    return {**config_args(args.config), **engine, **flags}


_ENGINE_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineConfig)}


def config_args(path: str) -> dict[str, Any]:
    """`build_app`'s args from a YAML file: a Serve config's one `serve_app:build_app` application, or the
    args themselves."""
    import yaml

    with open(path, encoding="utf-8") as f:
        doc = yaml.safe_load(f)
    if not isinstance(doc, dict):
        raise ValueError(f"--config {path}: expected a YAML mapping.")
    if "applications" not in doc:
        return doc
    apps = [a for a in doc["applications"] or [] if a.get("import_path") == BUILD_APP]
    if len(apps) != 1:
        raise ValueError(f"--config {path}: expected exactly one application with import_path {BUILD_APP}.")
    args = apps[0].get("args") or {}
    if not isinstance(args, dict):
        raise ValueError(f"--config {path}: the application's args must be a mapping.")
    return args


def _url_host(host: str) -> str:
    return "localhost" if host in ("0.0.0.0", "::", "") else host


def run_server(host: str, port: int, serve_args: dict[str, Any]) -> int:
    import ray
    from ray import serve

    from cluster.ray_utils import ensure_ray
    from raytp.openai.request_id import enable_proxy_guard
    from raytp.serve.app import build_app
    from raytp.serve.args import use_serve_defaults
    from raytp.serve.haproxy_env import release, use_private_haproxy
    from raytp.serve.port_guard import claim_port

    sa = ServeArgs.from_dict(serve_args)  # refuse bad flags before starting anything
    for model in sa.models:
        _check_model(model.engine)
    _check_adapters(sa)
    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        stop.set()
        raise KeyboardInterrupt  # also interrupts a deployment still in progress

    joined = ray.is_initialized() or bool(os.environ.get("RAY_ADDRESS"))
    haproxy_dir = None
    if not joined:
        claim_port(port)  # a leftover HAProxy on it is stopped, anything else refused, before Ray starts
        _claim_the_machines_cores(sa)
        haproxy_dir = use_private_haproxy(host)
    enable_proxy_guard()  # the HTTP proxies of a cluster started here validate X-Request-Id
    use_serve_defaults()  # ... and run Serve's high-throughput mode
    ensure_ray()
    # After ray.init: Ray installs its own SIGTERM handler there; ours must win.
    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(build_app(serve_args), name=APP_NAME, route_prefix="/")
        names = ", ".join(m.name for m in sa.models)
        base = f"http://{_url_host(host)}:{port}"
        _wait_until_healthy(base, HEALTHY_WITHIN_S)
        print(f"raytp: serving {names} at {base}  (OpenAI base URL: {base}/v1); Ctrl-C to stop", flush=True)
        _print_scrape_targets(base)
        while not stop.wait(3600):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        print("raytp: shutting down", file=sys.stderr, flush=True)
        try:
            _teardown(joined)
        finally:
            if haproxy_dir is not None:
                release(haproxy_dir)
    return 0


HEALTHY_WITHIN_S = 120.0


def _wait_until_healthy(base: str, within_s: float) -> None:
    """Return once `GET /health` on the API port answers 200, so "raytp: serving" means exactly that.

    Why: `serve.run` returns when the replica is healthy in Serve's controller, but the HTTP proxy
    (HAProxy) marks the replica's server up only after its own next check; until then /health is
    HAProxy's 503 (haproxy_shim.py). One CI run saw that 503 right after the "serving" line. Past
    `within_s` a warning is printed and the server keeps running: the app is deployed, only the
    proxy lags, and a client retrying on 503 still gets served.
    """
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never via $http_proxy
    deadline = time.monotonic() + within_s
    while True:
        try:
            with direct.open(base + "/health", timeout=10) as reply:
                if reply.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass  # 503 (HTTPError is a URLError), refused, or a timeout: not up yet
        if time.monotonic() > deadline:
            print(f"raytp: warning: {base}/health did not answer 200 within {within_s:.0f} s", file=sys.stderr)
            return
        time.sleep(0.2)


def _claim_the_machines_cores(sa: ServeArgs) -> None:
    """Size each model rank's Ray CPU reservation (and so its torch threads) to share this machine.

    Decision: a `raytp serve` that starts its own Ray owns the machine, so its ranks split the
    cores among them (TP=1, one replica: all of them) instead of the cluster default of one CPU
    per rank, which left a 2-core machine's second core idle while the only worker decoded on one
    thread. The other Serve actors reserve no CPU, so the reservations still fit. An explicit
    RAYTP_CPUS_PER_WORKER wins; with autoscaling the replica count is unknown and the default stays.
    Set before Ray starts: the raylet, and through it the controller, inherits this environment.
    """
    if os.environ.get("RAYTP_CPUS_PER_WORKER") or any(m.autoscaling_config is not None for m in sa.models):
        return
    ranks = sum(m.engine.tensor_parallel_size * (m.num_replicas or 1) for m in sa.models)
    os.environ["RAYTP_CPUS_PER_WORKER"] = str(max(1, (os.cpu_count() or 1) // ranks))


def _print_scrape_targets(base: str) -> None:
    """Where Prometheus finds raytp's metrics: every Ray node's metrics port (the cluster way, what
    k8s/prometheus/prometheus.yml and KubeRay's PodMonitors scrape) or the API port's /metrics."""
    from cluster.metrics.endpoint import node_metrics_urls

    nodes = ", ".join(node_metrics_urls()) or "(no Ray node exports metrics)"
    print(f"raytp: Prometheus metrics on the Ray nodes' metrics ports: {nodes}", flush=True)
    print(f"raytp: the same series on {base}/metrics (scrape one of the two, not both)", flush=True)


def _check_model(engine: EngineConfig) -> None:
    """Fail fast (ValueError -> exit 2) on a model that cannot be found or split, before Ray starts:
    inside Serve the same error would surface only as replica constructor retries."""
    from cluster.engine import read_checked_model

    read_checked_model(engine)


def _check_adapters(sa: ServeArgs) -> None:
    """Fail fast (LoRAError, a ValueError -> exit 2) on a --lora-modules adapter that cannot be served (no
    checkpoint there, a rank over max_lora_rank), before Ray starts."""
    from model_exec.lora.peft_config import read_adapter_config

    ranks = {m.name: m.engine.max_lora_rank for m in sa.models}
    for base, lora in sa.lora_requests():
        read_adapter_config(lora, ranks[base])


def _teardown(joined: bool) -> None:
    """Decision: a Ray this process started is shut down at once, without Serve's graceful shutdown first.
    `serve.shutdown()` waited for the controller to drain and stop every replica and gave up after 30 s
    ("Controller failed to shut down within 30.0s"), so Ctrl-C took 30-40 s; nothing outlives this Ray
    (the model's state is its memory), and `ray.shutdown()` ends every process of it: the raylet's end
    ends its workers, and HAProxy ends with its actor (haproxy_shim.py)."""
    import ray
    from ray import serve

    if joined:
        serve.delete(APP_NAME)
    else:
        ray.shutdown()
