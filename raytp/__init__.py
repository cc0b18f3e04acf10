"""raytp's front door: what users touch (the offline `LLM` API, the CLI, the OpenAI protocol, batch jobs).

    from raytp import LLM, SamplingParams

The same names as vLLM's top-level package, so code moves over by changing the import.

    raytp/llm.py      LLM: offline batched generation over the engine's output stream
    raytp/cli/        the `raytp` command (generate, serve, batch)
    raytp/openai/     the OpenAI protocol, the route table, request handlers and the FastAPI app
    raytp/serve/      the Ray Serve application that deploys them (serve_app.py names it)
    raytp/batch/      batch jobs: OpenAI batch files and Ray Datasets through the same handlers
"""

from cluster.config import EngineConfig
from cluster.engine import EngineDeadError
from cluster.outputs import CompletionOutput, Logprob, RequestOutput
from raytp.llm import LLM
from request.errors import RequestError
from request.lora import LoRAError, LoRARequest
from request.pooling_params import PoolingParams
from request.sampling_params import SamplingParams
from request.structured_outputs import StructuredOutputsParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "EngineDeadError",
    "LoRAError",
    "LoRARequest",
    "Logprob",
    "PoolingParams",
    "RequestError",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
]
