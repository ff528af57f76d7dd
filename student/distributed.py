"""Stage two on several processes under torchrun: the process group, FSDP2, each rank's share of
the data and of the loss, and sharded checkpoints (torch.distributed.checkpoint, DCP).

`torchrun --nproc-per-node N -m distill train-student ...` sets WORLD_SIZE, RANK and LOCAL_RANK;
with WORLD_SIZE > 1 the trainer calls `setup` (gloo on a CPU, nccl on GPUs, one GPU a process:
LOCAL_RANK's), shards the student with FSDP2's `fully_shard` (each decoder layer, then the root,
which keeps the embedding, final norm and lm-head), and every rank reads its own contiguous
share of every micro-batch (student.data.CacheBatches' `part`). `--batch-size` stays the
micro-batch over all ranks, so an optimizer step sees batch_size x grad_accum sequences at any
world size, in the same order.

Loss: the fused loss of a micro-batch is a mean over its rows. A rank holds some of those rows,
so it takes `whole` = the micro-batch's global row counts (one all-reduce of two integers) and
returns its rows' share of the global mean (student.loss.distill_loss's `whole`, as a chunk of
chunk-recurrent training does); FSDP then SUMS the ranks' gradients (its divide factor set to 1).
The sum over ranks equals the one-process loss and gradient in exact arithmetic; in floating point
they differ by the order of the sums over rows (tests/test_distributed.py holds the bound).

Optimizers: every rank steps its own rows. torch's AdamW keeps DTensor states itself; FOAM and
the 8-bit AdamW step on the local shards with states shaped for them, kept as DTensors sharded as
their parameters (student/optim/shards.py). FOAM folds within rows, so its steps and states are the
one-process ones; the 8-bit AdamW blocks each shard from its first element, the one-process blocks
only where shards start on block edges, so its checkpoints resume only at the world size that
wrote them (student/optim/adam8bit.py).

The sparse FFN: each rank measures its part of the micro-batches; its window sums the ranks'
measurements every step (`sum_over_ranks_`), so every rank decides the same routing and dead
neurons and moves the gate rows of its own shard (student/sparse_ffn.py).

Checkpoints written by a sharded run hold `dcp/` (the model and optimizer through DCP's
get_state_dict, so they reshard to any world size) beside trainer_state.pt and data.json
(student/checkpoint.py); a one-process run reads them with the same calls, and a sharded run
reads a one-process checkpoint (an HF folder and a full optimizer state) through full state dicts.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as tdist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)
from torch.distributed.fsdp import FSDPModule, fully_shard

from distill.configs import ConfigError
from distill.errors import DistillUserError

__all__ = ["Dist", "world_from_env", "setup", "teardown", "check_config", "shard_model", "global_rows",
           "padded_to_longest_part", "all_sum", "sum_over_ranks_", "rank0_first", "unsharded_root",
           "full_model_state", "save_sharded", "load_sharded", "load_full_into_sharded"]

@dataclass(frozen=True)
class Dist:
    """This process's place in the job (torchrun's environment)."""

    rank: int
    world_size: int
    local_rank: int

    @property
    def main(self) -> bool:
        return self.rank == 0


def world_from_env() -> Dist | None:
    """The job torchrun describes in the environment; None for one process (WORLD_SIZE unset or 1)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return None
    return Dist(int(os.environ["RANK"]), world_size, int(os.environ.get("LOCAL_RANK", "0")))


def check_config(config, dist: Dist) -> None:
    """Refuse, before any process group exists, settings a sharded run cannot take."""
    if config.batch_size % dist.world_size:
        raise ConfigError("batch_size", f"is {config.batch_size}, which does not divide among the {dist.world_size} "
                                        "processes (it is the micro-batch over all of them, each takes an equal "
                                        f"share); give a multiple of {dist.world_size}")
    if config.offload.offload != "none":
        raise ConfigError("offload", f"is {config.offload.offload!r}: offloaded training runs in one process; "
                                     "drop --offload or run without torchrun")
    if config.device.startswith("cuda:"):
        raise ConfigError("device", f"is {config.device!r}: under torchrun each process takes the GPU of its "
                                    "LOCAL_RANK; give --device cuda or auto")


def setup(dist: Dist, device: str) -> None:
    """Join the process group (gloo on a CPU, nccl on GPUs); on GPUs make LOCAL_RANK's the current one."""
    if device.startswith("cuda"):
        torch.cuda.set_device(dist.local_rank)
    if not tdist.is_initialized():
        tdist.init_process_group("nccl" if device.startswith("cuda") else "gloo")


def teardown() -> None:
    if tdist.is_initialized():
        tdist.destroy_process_group()


def shard_model(model) -> None:
    """FSDP2 over `model` (a Student), in place: each decoder layer its own unit, then the root. The
    root keeps its parameters gathered after the forward: the loss reads the lm-head outside the
    model's forward. Gradients are summed over ranks, not averaged (module docstring)."""
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model, reshard_after_forward=False)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # gloo has no pre-multiplied sum


def global_rows(batch, device: str) -> tuple[int, int]:
    """(real rows (Batch.kd_rows), rows with a next token) of the micro-batch of which `batch` is this
    rank's part."""
    counts = torch.tensor([int(batch.kd_rows.sum()), int((batch.mask & (batch.target_ids >= 0)).sum())],
                          dtype=torch.int64, device=device)
    tdist.all_reduce(counts)
    return int(counts[0]), int(counts[1])


def padded_to_longest_part(batch, device: str):
    """`batch` padded to the longest rank's part of its micro-batch (one all-reduce): chunk-recurrent
    training then cuts every rank's part into the same chunks, so their collectives pair up."""
    longest = torch.tensor([batch.input_ids.shape[1]], dtype=torch.int64, device=device)
    tdist.all_reduce(longest, op=tdist.ReduceOp.MAX)
    return batch.padded_to(int(longest))


def all_sum(values: list[float], device: str) -> list[float]:
    """The sums over ranks of `values` (float64)."""
    summed = torch.tensor(values, dtype=torch.float64, device=device)
    tdist.all_reduce(summed)
    return summed.tolist()


def sum_over_ranks_(tensor):
    """`tensor` summed over the ranks, in place (one all-reduce); returns it."""
    tdist.all_reduce(tensor)
    return tensor


def rank0_first(dist: Dist | None, work):
    """work() on rank 0 alone, its result handed to every rank; a user error it raises is raised on
    every rank (so all stop with the same line, none waits in a collective)."""
    if dist is None:
        return work()

    shared = [None]
    if dist.main:
        try:
            shared[0] = ("ok", work())
        except DistillUserError as e:
            shared[0] = ("error", e)
    tdist.broadcast_object_list(shared, src=0)
    kind, value = shared[0]
    if kind == "error":
        raise value
    return value


@contextlib.contextmanager
def unsharded_root(model, sharded: bool):
    """The root's parameters (embedding, final norm, lm-head) gathered while the block runs: code
    that reads `model.lm_head_weight` before a forward (evaluation) sees the whole matrix."""
    if not sharded:
        yield
        return
    model.unshard()
    try:
        yield
    finally:
        model.reshard()


def full_model_state(model) -> dict:
    """The whole model state dict on rank 0's host (gathered from every rank; others get {})."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def save_sharded(folder, model, optimizer) -> None:
    """Write the model and optimizer (each rank its shards) to `folder` through DCP."""
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(folder))


def load_sharded(folder, model, optimizer) -> None:
    """Load `save_sharded`'s model and optimizer into `model` (sharded or not, any world size),
    keeping the optimizer's hyperparameters (a resumed run may change them)."""
    settings = _settings(optimizer)
    model_state, optim_state = get_state_dict(model, optimizer)  # allocates the optimizer's states to load into
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=str(folder))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    _restore_settings(optimizer, settings)


def load_full_into_sharded(model, optimizer, model_state: dict, optim_state: dict) -> None:
    """Load a one-process checkpoint (full model state dict; optimizer.state_dict() of the same
    optimizer over the unsharded model, keyed by parameter index) into the sharded `model`."""
    names = {id(p): name for name, p in model.named_parameters()}
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    saved_ids = [i for group in optim_state["param_groups"] for i in group["params"]]
    if len(saved_ids) != len(order):
        raise DistillUserError(f"the checkpoint's optimizer holds {len(saved_ids)} parameters, this model "
                               f"{len(order)}; use a new `out` or remove that checkpoint")
    by_name = dict(zip(saved_ids, order))
    optim_full = {"state": {by_name[i]: s for i, s in optim_state["state"].items()},
                  "param_groups": [{**g, "params": [by_name[i] for i in g["params"]]} for g in optim_state["param_groups"]]}
    settings = _settings(optimizer)
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_full,
                   options=StateDictOptions(full_state_dict=True))
    _restore_settings(optimizer, settings)


def _settings(optimizer) -> list[dict]:
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


def _restore_settings(optimizer, settings: list[dict]) -> None:
    for group, kept in zip(optimizer.param_groups, settings):
        group.update(kept)
