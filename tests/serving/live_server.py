"""A live raytp Serve app on 127.0.0.1 for the serving tests: one per test module, or the shared one.

Each server gets its own local Ray (4 logical CPUs, so TP workers' 1-CPU bundles fit on a
2-core machine) and a free port; nothing is hard-coded. The test process is the Ray
driver, so tests can also reach the deployments (for get_stats) and the actors.

One Ray per process: starting a server ends the one before it. `shared_server()` is the exception that
outlives a module: modules that need the plain SMALL_ENGINE server and change nothing about it share one
(tests/serving/conftest.py orders them next to each other, so it starts once).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import openai
import ray
import requests
from ray import serve

from cluster.loop_records import LoopStats, ModelInfo
from raytp.openai.request_id import enable_proxy_guard
from raytp.serve.app import build_app
from raytp.serve.haproxy_env import release
from tests.helpers.ports import free_port
from tests.helpers.serve_env import serve_defaults

APP = "raytp"
# Small KV pools: several engines (the server's and the offline reference) share the machine.
SMALL_ENGINE = {"max_model_len": 512, "kv_cache_memory_bytes": 1 << 28, "swap_space": 0.25}


@dataclass
class LiveServer:
    base_url: str  # http://127.0.0.1:PORT
    engine_deployment: str = "OpenAIIngress"  # the deployment whose replica hosts the engine (one replica here)

    def url(self, path: str) -> str:
        return self.base_url + path

    def client(self, api_key: str = "unused", **kw: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url("/v1"), api_key=api_key, max_retries=0, **kw)

    def async_client(self, api_key: str = "unused") -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url("/v1"), api_key=api_key, max_retries=0, timeout=300)

    def stats(self) -> LoopStats:
        """The engine's get_stats, from the deployment that hosts it."""
        handle = serve.get_deployment_handle(self.engine_deployment, APP)
        result: LoopStats = handle.get_stats.remote().result(timeout_s=30)
        return result

    def model_info(self) -> ModelInfo:
        handle = serve.get_deployment_handle("OpenAIIngress", APP)
        result: ModelInfo = handle.model_info.remote().result(timeout_s=30)
        return result

    def wait_idle(self, timeout_s: float = 60.0) -> LoopStats:
        """Stats once no request is in flight and every device KV block is free again."""
        deadline = time.monotonic() + timeout_s
        while True:
            st = self.stats()
            if st.idle:
                return st
            if time.monotonic() > deadline:
                raise AssertionError(f"engine not idle after {timeout_s} s: {st}")
            time.sleep(0.2)


@contextmanager
def live_server(args: dict[str, Any], num_cpus: int = 4) -> Iterator[LiveServer]:
    stop_shared_server()  # its Ray is about to end: forget it, so the next user starts a fresh one
    if ray.is_initialized():
        ray.shutdown()
    enable_proxy_guard()  # as `raytp serve` does: the proxies it starts validate X-Request-Id,
    with serve_defaults() as haproxy_dir:  # and Serve runs in its high-throughput mode
        _start_local_ray(num_cpus)
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(args), name=APP, route_prefix="/")
        yield LiveServer(f"http://127.0.0.1:{port}", "LLMServer" if args.get("split_ingress") else "OpenAIIngress")
    finally:
        stop_serve_with_ray()
        release(haproxy_dir)


def _start_local_ray(num_cpus: int) -> None:
    """A local Ray for one server; started a second time if its node did not register, or its GCS did not write
    its port file, within Ray's fixed timeouts (fresh-clone CI runs on 2026-11-29 lost a whole module to "The
    current node timed out during startup" and to "Timed out waiting for file .../gcs_server_port..." while the
    other xdist worker loaded both cores). Any other error, or a second timeout, fails the test."""
    for attempt in (1, 2):
        try:
            ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
            return
        except Exception as e:
            startup_timeout = "timed out during startup" in str(e) or "Timed out waiting for file" in str(e)
            if attempt == 2 or not startup_timeout:
                raise
            ray.shutdown()


def stop_serve_with_ray() -> None:
    """End a test's Serve as `raytp serve` ends its own (raytp/cli/serve.py `_teardown`): `ray.shutdown()` at
    once. `serve.shutdown()` first would wait out Serve's drain period for direct-ingress replicas (30 s in
    Ray 2.60, "Controller failed to shut down within 30.0s") at every module's end, about 6 minutes a suite;
    the local Ray's end ends every replica, engine worker and HAProxy (haproxy_shim.py) of it."""
    ray.shutdown()


_shared: tuple[ExitStack, LiveServer] | None = None


def shared_server() -> LiveServer:
    """The SMALL_ENGINE server (SmolLM2, TP=1, one replica, no API key, max_num_seqs 256), started on first use
    and kept until another server starts or the serving tests end.

    NOT for a test that changes the server: kills or restarts its engine, replicas or workers, loads or
    unloads LoRA adapters, needs other flags (API key, limits, replicas, TP), reads counters that other
    modules' requests also move without taking a before/after difference, or leaves requests running.
    A test using it must leave the engine idle with every KV block free (`wait_idle`), as the modules that
    use it check after each test."""
    global _shared
    if _shared is None:
        stack = ExitStack()
        server = stack.enter_context(live_server(SMALL_ENGINE))
        _shared = (stack, server)
    return _shared[1]


def stop_shared_server() -> None:
    global _shared
    if _shared is not None:
        stack, _shared = _shared[0], None
        stack.close()


def sse_payloads(resp: requests.Response) -> list[Any]:
    """The `data:` payloads of an SSE response, JSON-decoded; "[DONE]" stays a string."""
    out: list[Any] = []
    for line in resp.iter_lines(decode_unicode=True):
        if not line:
            continue
        assert line.startswith("data: "), f"not an SSE data line: {line!r}"
        data = line[len("data: ") :]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out
