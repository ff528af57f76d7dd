"""The offload runtime's clock: the step's phases (student/planner/costs.py's PHASES, which the
planner predicts) as student/offload/runtime.py's OffloadRuntime goes through them."""

from __future__ import annotations

import time

import torch

__all__ = ["PhaseClock"]


class PhaseClock:
    """The step's phases as the runtime goes through them (the names of student/planner/solve.py's
    PHASES, which the planner predicts): points on the device are CUDA events on the compute
    stream, read once the host waits for them anyway; points on the host are perf_counter
    readings; on a CPU device every point is a perf_counter reading."""

    def __init__(self, device: torch.device):
        self.device, self.cuda = device, device.type == "cuda"
        self.micro: list[dict] = []  # per micro-batch: fwd0 (first layer's forward), fwd1 (last's end), bwd0, bwd1
        self.step: dict[str, float] = {}  # the step's phases so far, seconds
        self.marks: dict[str, float] = {}  # host readings of the step
        self.device_marks: dict[str, object] = {}  # CUDA events of the step's update (on the compute stream)

    def mark(self, name: str) -> None:
        if self.cuda:
            value = torch.cuda.Event(enable_timing=True)
            value.record(torch.cuda.current_stream(self.device))
        else:
            value = time.perf_counter()
        if name == "fwd0":
            self.micro.append({})
        if self.micro:
            self.micro[-1][name] = value

    def seconds(self, a, b) -> float:
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a

    def backward_done(self) -> None:
        """The host waits for the last backward (finish_grads): the device phases of the step's micro-batches."""
        done = [m for m in self.micro if {"fwd0", "fwd1", "bwd0", "bwd1"} <= m.keys()]
        if done and self.cuda:
            done[-1]["bwd1"].synchronize()
        # The forwards without a backward (chunk-recurrent pass 1) count as forward time too.
        forwards = [m for m in self.micro if {"fwd0", "fwd1"} <= m.keys()]
        self.step = {"forward": sum(self.seconds(m["fwd0"], m["fwd1"]) for m in forwards),
                     "head": sum(self.seconds(m["fwd1"], m["bwd0"]) for m in done),
                     "backward": sum(self.seconds(m["bwd0"], m["bwd1"]) for m in done)}
        self.micro, self.marks = [], {"grads0": time.perf_counter()}

    def host_mark(self, name: str) -> None:
        self.marks[name] = time.perf_counter()

    def device_mark(self, name: str) -> None:
        if self.cuda:
            self.device_marks[name] = torch.cuda.Event(enable_timing=True)
            self.device_marks[name].record(torch.cuda.current_stream(self.device))

    def phases(self, optimizer: str) -> dict[str, float]:
        """The last step's phases, seconds, once the step's update is queued (`OffloadRuntime.phase_s`;
        `optimizer`: the plan's side of the update); waits for the device. {} before a step."""
        marks = self.marks
        if "updated" not in marks:
            return {}
        if self.cuda:
            torch.cuda.synchronize(self.device)
        end = time.perf_counter()
        phases = dict(self.step, grads=marks["grads1"] - marks["grads0"], clip=marks["step0"] - marks["grads1"])
        if optimizer == "cpu":  # the host updates, then what the device still does: the refresh
            phases.update(optimizer=marks["updated"] - marks["step0"], refresh=end - marks["updated"])
        elif self.cuda:  # queued on the device: until the compute stream is through (the copies out
            # of the last layers overlap the next step)
            phases.update(optimizer=self.device_marks["step0"].elapsed_time(self.device_marks["updated"]) / 1e3,
                          refresh=0.0)
        else:
            phases.update(optimizer=marks["updated"] - marks["step0"], refresh=0.0)
        self.marks = {}
        return phases
