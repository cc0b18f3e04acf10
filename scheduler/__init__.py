"""Requests, sequences, sampling params and the continuous-batching scheduler (no torch here)."""

from request.sampling_params import SamplingParams
from scheduler.config import SchedulerConfig
from scheduler.outputs import CachedSeqData, ModelRunnerOutput, NewSeqData, SchedulerOutput, SeqSample
from scheduler.sequence import Sequence, SequenceGroup, SequenceStatus

__all__ = [
    "CachedSeqData",
    "ModelRunnerOutput",
    "NewSeqData",
    "SamplingParams",
    "SchedulerConfig",
    "SchedulerOutput",
    "SeqSample",
    "Sequence",
    "SequenceGroup",
    "SequenceStatus",
]
