"""Worker: one tensor-parallel rank, and the whole protocol between the controller and a rank.

The same class runs in-process (TP=1, `InProcessExecutor`) and as the Ray actor of each rank
(`RayExecutor` wraps this very class with `ray.remote`), so the protocol is written once:

    node_info (Ray only) -> load_model -> quantization, determine_num_blocks -> init_cache -> execute_model per step

Every per-rank operation is a public method here and nowhere else: the executors reach it by name through
`collective_rpc` (the step itself through `execute_model`), so adding one is one method in this file.

Decision: this module imports no torch. The tensors live in `model_exec.shard.ModelShard`,
imported when the model loads, i.e. inside the rank's own process. The controller can then
create worker actors without paying torch's import time and memory itself.
Nor does it import Ray: the in-process road (TP=1 offline) must run where Ray is not installed
(a bare GPU box: benchmarks/gpu_check.py). Only Ray ranks call `node_info` and `start_metrics`,
which import it; `ping`'s own concurrency group is named by the caller (`RayExecutor`).
"""

from __future__ import annotations

import os
import pickle
import socket
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cluster.config import ResolvedEngineConfig, default_kv_cache_bytes
from cluster.heap import freeze_startup_heap, thaw_heap
from model_exec.config import ModelConfig
from model_exec.source import resolve_model
from request.lora import LoRAError, LoRARequest
from scheduler.outputs import ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from cluster.metrics.ray_metrics import WorkerMetrics
    from model_exec.shard import ModelShard
    from model_exec.step_launch import LaunchedStep


@dataclass(frozen=True)
class NodeInfo:
    node_id: str
    ip: str
    free_port: int  # bound and released just now on this node: rank 0's offer for the rendezvous
    default_kv_bytes: int  # this node's default CPU KV budget, to share among the ranks placed on it
    pid: int  # the rank's process, named in failure logs


class Worker:
    def __init__(
        self,
        config: ResolvedEngineConfig,
        model_config: ModelConfig,  # resolved once by the controller
        rank: int = 0,
        world_size: int = 1,
        num_threads: int | None = None,  # torch threads for this rank (a Ray rank: its bundle's CPUs)
    ) -> None:
        self.config = config
        self.model_config = model_config
        self.rank = rank
        self.world_size = world_size
        self.num_threads = num_threads
        self.shard: ModelShard | None = None
        self.kv_cache_bytes: int | None = None  # CPU KV budget of this rank (set by load_model); None: the default
        self.metrics: WorkerMetrics | None = None  # set by start_metrics (a serving controller); None offline

    def node_info(self) -> NodeInfo:
        """Where this rank runs (Ray ranks report it before the TP rendezvous)."""
        import ray

        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        node_id = ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
        return NodeInfo(node_id, ray.util.get_node_ip_address(), port, default_kv_cache_bytes(), os.getpid())

    def load_model(self, dist_init_method: str | None = None, kv_cache_bytes: int | None = None) -> None:
        """Join the TP group (at `dist_init_method`, for world_size > 1), build this rank's shard, load it.
        `kv_cache_bytes`: this rank's CPU KV budget when it shares a node with other ranks (the Ray executor's
        share of the node's default), else the configured kv_cache_memory_bytes or the machine's default."""
        self.kv_cache_bytes = kv_cache_bytes
        if self.num_threads is not None:
            import torch

            torch.set_num_threads(self.num_threads)
        from model_exec.shard import ModelShard

        # Passed whole: the engine decided every field once (cluster/engine.py resolve_config).
        self.shard = ModelShard(
            resolve_model(self.config.model, self.config.revision),
            self.model_config,
            self.config.shard,
            rank=self.rank,
            world_size=self.world_size,
            dist_init_method=dist_init_method,
        )

    def quantization(self) -> str:
        """The quantization this rank's weights run ("fp8" | "gguf" | "int8" | "none"): what the rank decided at
        load from the setting, the checkpoint and its device (`select_quantization`), not the setting itself."""
        return self._shard().quantization

    def determine_num_blocks(self) -> tuple[int, int]:
        """(device blocks, CPU swap blocks) this rank can hold; the engine takes the minimum over ranks.

        On the CPU the pool gets `kv_cache_bytes` (given to load_model), else the configured
        kv_cache_memory_bytes, else the machine's default.
        """
        shard = self._shard()
        cfg = self.config
        per_block = shard.bytes_per_block
        num_cpu = cfg.swap_space_bytes // per_block
        if cfg.num_gpu_blocks_override is not None:
            return cfg.num_gpu_blocks_override, num_cpu
        if shard.device.type == "cuda":
            blocks = shard.profile_cuda_blocks(cfg.max_num_batched_tokens, cfg.max_num_seqs, cfg.gpu_memory_utilization)
            return blocks, num_cpu
        budget = self.kv_cache_bytes or cfg.kv_cache_memory_bytes or default_kv_cache_bytes()
        return max(budget // per_block, 1), num_cpu

    def init_cache(self, num_device_blocks: int, num_cpu_blocks: int) -> None:
        self._shard().init_cache(num_device_blocks, num_cpu_blocks)
        freeze_startup_heap()  # the rank is ready: its steps' collections skip the model's heap (cluster/heap.py)

    def execute_model(self, so: SchedulerOutput | bytes) -> ModelRunnerOutput | None:
        """One step. The Ray executor sends the pickled SchedulerOutput (pickled once for every rank)."""
        start = time.perf_counter()
        if isinstance(so, bytes):
            so = pickle.loads(so)  # sent by our own controller, inside the cluster
            assert isinstance(so, SchedulerOutput)
        out = self._shard().execute(so)
        if self.metrics is not None:
            self.metrics.record_step(time.perf_counter() - start)
        return out

    def launch_model(self, so: SchedulerOutput) -> LaunchedStep:
        """One step in two halves, in this process (the in-process executor's asynchronous step): returns once
        the step is enqueued; the step's `resolve()` gives the ModelRunnerOutput (model_exec/step_launch.py)."""
        start = time.perf_counter()
        launched = self._shard().launch(so)
        if self.metrics is not None:
            self.metrics.record_step(time.perf_counter() - start)  # the host's part: the device's runs on
        return launched

    def add_lora(self, lora: LoRARequest) -> None:
        """Load a PEFT adapter's shard on this rank, keyed by lora_int_id (an id already loaded is replaced).
        LoRAError naming the adapter and the cause, with the rank's adapters unchanged, when it cannot."""
        manager = self._shard().lora
        if manager is None:
            raise LoRAError(f"LoRA adapter {lora.lora_name!r}: this engine was started without enable_lora.")
        manager.add(lora)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Drop an adapter; False when this rank does not hold it."""
        manager = self._shard().lora
        return manager.remove(lora_int_id) if manager is not None else False

    def list_loras(self) -> list[int]:
        """The lora_int_ids this rank holds, ascending."""
        manager = self._shard().lora
        return manager.lora_ids() if manager is not None else []

    def start_metrics(self, model_name: str, replica: str) -> None:
        """Record this rank's execute_model wall time from now on, labelled with its rank."""
        from cluster.metrics.ray_metrics import WorkerMetrics

        self.metrics = WorkerMetrics(model_name, replica, self.rank)

    def ping(self) -> None:
        """Answers even while a step runs: a Ray rank serves it in the "control" concurrency group, which
        `RayExecutor` names on every call; health checks never queue behind a step."""

    def shutdown(self) -> None:
        if self.shard is not None:
            self.shard.shutdown()
        thaw_heap()

    def _shard(self) -> ModelShard:
        assert self.shard is not None, "load_model first"
        return self.shard
