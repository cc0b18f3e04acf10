"""raytp's engine layer: the engine loop, executors, workers, the offline `LLM` API and the CLI."""

from cluster.config import EngineConfig
from cluster.engine import EngineDeadError, LLMEngine
from cluster.llm import LLM
from cluster.outputs import CompletionOutput, Logprob, RequestOutput
from scheduler.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "EngineDeadError",
    "LLMEngine",
    "Logprob",
    "RequestOutput",
    "SamplingParams",
]
