"""Batch jobs: OpenAI batch JSONL in, one answer per `custom_id` out, exactly once across reruns.

input.py (streamed reading and whole-file validation) -> journal.py (what is committed) ->
runner.py (Ray Data over engine replicas) -> output.py (final files) and status.py (Batch object).
processor.py: the same replicas over a user's own Ray Dataset (`build_processor`, as Ray Data LLM).
"""

from raytp.batch.processor import Processor, ProcessorConfig, build_processor

__all__ = ["Processor", "ProcessorConfig", "build_processor"]
