"""A step's results read back to the host beside the next step: the copy on a side stream, an event to wait on.

vLLM V1's async step, the copy half: the launch enqueues the step's kernels on the compute stream, then
`Readback.start` makes a side stream wait for them (an event recorded on the compute stream), enqueues the
copies of the results into pinned host memory there, and records a completion event. The host thread returns at
once; the compute stream is free to take the next step's kernels, which never wait for the copy. `wait` blocks on
the completion event only (never on the compute stream), so a resolve waits for step N's copy while step N+1
runs.

The device calls go through `DeviceApi` (streams, events, pinned buffers): `CudaApi` is torch.cuda's; tests
pass a fake whose events complete when the test says so (tests/cluster/test_async_step_launch.py). On the CPU
there is no device to overlap: the "read back" tensors are the results themselves, complete at once.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch


class DeviceEvent(Protocol):
    def record(self, stream: Any) -> None: ...

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class DeviceApi(Protocol):
    """The few device calls a readback makes."""

    def current_stream(self) -> Any: ...

    def new_stream(self) -> Any: ...

    def new_event(self) -> DeviceEvent: ...

    def wait_event(self, stream: Any, event: DeviceEvent) -> None: ...

    def copy_to_host(self, src: torch.Tensor, stream: Any) -> torch.Tensor:
        """Enqueue on `stream` a copy of src into new pinned host memory; src stays alive until it ran."""
        ...


class CudaApi:
    """torch.cuda's streams and events (import-guarded: built only on a CUDA device)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def current_stream(self) -> Any:
        return torch.cuda.current_stream(self.device)

    def new_stream(self) -> Any:
        return torch.cuda.Stream(self.device)

    def new_event(self) -> DeviceEvent:
        return torch.cuda.Event()

    def wait_event(self, stream: Any, event: DeviceEvent) -> None:
        stream.wait_event(event)

    def copy_to_host(self, src: torch.Tensor, stream: Any) -> torch.Tensor:
        with torch.cuda.stream(stream):
            host = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
            host.copy_(src, non_blocking=True)
        # src was made on the compute stream: the allocator must not hand its memory on before this copy ran
        src.record_stream(stream)
        return host


class Readback:
    """Host copies of some device tensors, complete once `wait` returns (`done` says so without waiting)."""

    def __init__(self, host: list[torch.Tensor], event: DeviceEvent | None) -> None:
        self._host = host
        self._event = event  # None: complete from the start (the CPU road)

    def done(self) -> bool:
        return self._event is None or self._event.query()

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()

    def host(self) -> list[torch.Tensor]:
        """The copies; call after `wait` (before it they may still be being written)."""
        return self._host


class Reader:
    """Starts readbacks on one side stream of a device (`api`), or none on the CPU (`api` None)."""

    def __init__(self, api: DeviceApi | None) -> None:
        self.api = api
        self._stream = api.new_stream() if api is not None else None

    def start(self, tensors: list[torch.Tensor]) -> Readback:
        if self.api is None:
            return Readback(tensors, None)
        api = self.api
        computed = api.new_event()
        computed.record(api.current_stream())  # after the kernels that produce `tensors`
        api.wait_event(self._stream, computed)
        host = [api.copy_to_host(t, self._stream) for t in tensors]
        copied = api.new_event()
        copied.record(self._stream)
        return Readback(host, copied)


def reader_for(device: torch.device) -> Reader:
    return Reader(CudaApi(device) if device.type == "cuda" else None)
