"""The side streams of the offload runtime (student/offload/runtime.py) and its update ring
(student/offload/update.py): making them, queueing work on them, and ordering one after another by
events. On a CPU device there are no streams and no events: each of these is then a no-op (None for
a stream or an event), so the runtime's code path is the same on both."""

from __future__ import annotations

import contextlib

import torch

__all__ = ["Streams"]


class Streams:
    """Stream helpers for one device (CUDA, or a CPU where each does nothing)."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"

    def new(self):
        """A new side stream on the device (None on a CPU)."""
        return torch.cuda.Stream(self.device) if self.cuda else None

    def side(self, stream):
        """A context in which the work queued goes to `stream` (on a CPU: runs where it is)."""
        return torch.cuda.stream(stream) if self.cuda else contextlib.nullcontext()

    def record(self, stream):
        """An event at the current end of `stream`'s work (None on a CPU)."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait(self, event, stream=None) -> None:
        """`stream` (the compute stream by default) waits for `event` (None: nothing to wait for)."""
        if event is not None:
            (stream or torch.cuda.current_stream(self.device)).wait_event(event)

    def synchronize(self) -> None:
        """The host waits for all the device's work (on a CPU there is none queued)."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
