"""raytp's front door: what users touch (the offline `LLM` API, the CLI, the OpenAI protocol, batch jobs).

    from raytp import LLM, SamplingParams

The same names as vLLM's top-level package, so code moves over by changing the import.
"""

from cluster.config import EngineConfig
from cluster.llm import LLM
from cluster.outputs import CompletionOutput, Logprob, RequestOutput
from scheduler.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "EngineConfig", "Logprob", "RequestOutput", "SamplingParams"]
