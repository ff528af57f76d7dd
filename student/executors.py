"""Where a training step runs: one object chosen at start-up, which the loop (student/trainer.py)
talks to without asking which it is (as torchtitan applies parallelism to the model up front, and
vLLM's executors decide where work runs while its workers decide how).

  LocalExecutor     one process, the model on its device
  ShardedExecutor   FSDP2 under torchrun: parameters, gradients and states sharded over ranks
                    (student/distributed.py); the step's rows split among them
  OffloadExecutor   one process under an offload plan: decoder layers' fp32 masters, gradients and
                    states in host memory, bf16 working weights streamed (student/offload/runtime.py)

Each offers what a step needs: the backward of a micro-batch, the step's totals, finishing and
clipping the gradients, the optimizer's step, checkpoints, evaluation's view of the model, the
final student and the figures its runtime adds to a metrics row. `make_executor` chooses.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
import torch.distributed as tdist

from student.checkpoint import (is_sharded_checkpoint, load_checkpoint, load_sharded_checkpoint, save_checkpoint,
                                save_sharded_checkpoint, save_student)
from student.distributed import (Dist, all_sum, full_model_state, global_rows, padded_to_longest_part, rank0_first,
                                 shard_model, sum_over_ranks_, unsharded_root)
from student.model import Student
from student.offload.plan import OffloadPlan
from student.offload.run import cap_allocator, caps_allocator, offload_figures, plan_for_run, told_over_budget
from student.offload.runtime import OffloadRuntime
from student.optim.clip import clip_grad_norm_foreach
from student.step import autocast_dtype, micro_batch_backward, steps_accumulate
from student.train_config import TrainConfig

__all__ = ["LocalExecutor", "OffloadExecutor", "ShardedExecutor", "make_executor"]


class LocalExecutor:
    """One process; the model on `config.device`."""

    main = True  # the process that writes the run directory
    data_part = (0, 1)  # (this process's index, processes): which rows of each micro-batch it trains
    reduce = None  # the sum over processes of a tensor, in place (None: one process)

    def __init__(self, config: TrainConfig):
        self.config, self.model = config, None

    @property
    def model_device(self) -> str:
        """Where the initial student is built."""
        return self.config.device

    def run_first(self, work):
        """work() before the other processes go on, its result (or its user error) handed to all."""
        return work()

    def place(self, model) -> None:
        """Take the model, before the optimizer sees its parameters."""
        self.model = model

    def run_info(self) -> dict:
        """What run.json records of this executor."""
        return {}

    def backward(self, batch, *, cache_temperature: float, policy) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward and backward of one micro-batch; its (loss, KL), detached."""
        return micro_batch_backward(self.model, batch, self.config, autocast_dtype(self.config),
                                    cache_temperature=cache_temperature, policy=policy)

    def totals(self, loss_sum: float, kl_sum: float, tokens: int) -> tuple[float, float, int]:
        """The step's sums over every process."""
        return loss_sum, kl_sum, tokens

    def clip_grads(self, max_norm: float) -> float:
        """Finish the step's gradients and clip them to `max_norm` (inf: only measure); the total norm."""
        return clip_grad_norm_foreach(self.model.parameters(), max_norm).item()

    def optimizer_step(self, optimizer) -> None:
        optimizer.step()

    def save(self, out: Path, step: int, optimizer, trainer_state: dict, data_state: dict) -> Path:
        """Checkpoint `step` (student/checkpoint.py); its folder."""
        return save_checkpoint(out, step, self.model, {**trainer_state, "optimizer": optimizer.state_dict()},
                               data_state, keep=self.config.keep_checkpoints)

    def load(self, ckpt: Path, optimizer) -> tuple[dict, dict]:
        """Load checkpoint `ckpt` into the model (and, where sharded, the optimizer); (trainer state, data
        state). A trainer state that still holds "optimizer" is the caller's to load."""
        if is_sharded_checkpoint(ckpt):
            return load_sharded_checkpoint(ckpt, self.model, optimizer)
        return load_checkpoint(ckpt, self.model)

    def evaluating(self):
        """A context in which the model's whole weights are readable (evaluation)."""
        return contextlib.nullcontext()

    def figures(self, optimizer, step_s: float, peak: dict) -> dict:
        """What this executor adds to a metrics row (step_s: mean seconds of the window's steps)."""
        return {}

    def save_student(self, folder: Path, tokenizer_dir: str, checkpoint: Path | None = None) -> None:
        """The final student; `checkpoint`: the run's last, which holds these weights (linked, not written
        again: student/checkpoint.py's save_student)."""
        save_student(self.model, folder, tokenizer_dir, checkpoint)

    def close(self) -> None:
        """Every copy done; the model runs by itself again."""


class ShardedExecutor(LocalExecutor):
    """FSDP2 under torchrun: each process trains its share of every micro-batch's rows; gradients
    are summed over ranks, checkpoints written through torch.distributed.checkpoint."""

    def __init__(self, config: TrainConfig, dist: Dist):
        super().__init__(config)
        self.dist = dist
        self.main, self.data_part, self.reduce = dist.main, (dist.rank, dist.world_size), sum_over_ranks_

    def run_first(self, work):
        return rank0_first(self.dist, work)

    def place(self, model) -> None:
        shard_model(model)
        self.model = model

    def backward(self, batch, *, cache_temperature: float, policy):
        whole = global_rows(batch, self.config.device)
        if self.config.long.chunk_tokens is not None:
            batch = padded_to_longest_part(batch, self.config.device)
        return micro_batch_backward(self.model, batch, self.config, autocast_dtype(self.config),
                                    cache_temperature=cache_temperature, policy=policy, whole=whole)

    def totals(self, loss_sum, kl_sum, tokens):
        # Each rank holds its rows' share of the means: their sum is the step's.
        loss_sum, kl_sum, tokens = all_sum([loss_sum, kl_sum, tokens], self.config.device)
        return loss_sum, kl_sum, int(tokens)

    def clip_grads(self, max_norm: float) -> float:
        return clip_grad_norm_foreach(self.model.parameters(), max_norm).full_tensor().item()

    def save(self, out, step, optimizer, trainer_state, data_state):
        return save_sharded_checkpoint(out, step, self.model, optimizer, trainer_state, data_state, self.dist,
                                       keep=self.config.keep_checkpoints)

    def load(self, ckpt, optimizer):
        return load_sharded_checkpoint(ckpt, self.model, optimizer)

    def evaluating(self):
        return unsharded_root(self.model, True)

    def save_student(self, folder, tokenizer_dir, checkpoint=None):
        """The full weights gathered to rank 0, which writes them (a sharded checkpoint has no weights
        file to link)."""
        state = full_model_state(self.model)  # collective: every rank takes part
        if self.main:
            with torch.device("meta"):  # no initialisation: the gathered weights are assigned
                plain = Student(self.model.config)
            plain.load_state_dict(state, assign=True)
            save_student(plain, folder, tokenizer_dir)
        tdist.barrier()


class OffloadExecutor(LocalExecutor):
    """One process under an offload plan: the model is built in host memory and the runtime moves
    its decoder layers (student/offload/runtime.py); the results are those of LocalExecutor."""

    def __init__(self, config: TrainConfig, plan: OffloadPlan):
        super().__init__(config)
        self.plan, self.runtime, self.over_budget_told = plan, None, False

    @property
    def model_device(self) -> str:
        return "cpu"  # its decoder layers stay there

    def place(self, model) -> None:
        self.model = model
        self.runtime = OffloadRuntime(model, self.plan, self.config.device, autocast_dtype(self.config),
                                      accumulates=steps_accumulate(self.config))
        if caps_allocator(self.config):  # train() lifts it
            cap_allocator(self.config.offload.gpu_memory_bytes, self.config.device)

    def run_info(self) -> dict:
        return {"offload_plan": self.runtime.plan.to_dict()}

    def clip_grads(self, max_norm: float) -> float:
        self.runtime.finish_grads()
        return self.runtime.clip_grad_norm(max_norm).item()  # the same clipping, no host pass

    def optimizer_step(self, optimizer) -> None:
        self.runtime.step(optimizer)

    def save(self, out, step, optimizer, trainer_state, data_state):
        self.runtime.synchronize()  # the host weights and states are written by copies in flight
        return super().save(out, step, optimizer, trainer_state, data_state)

    def load(self, ckpt, optimizer):
        loaded = super().load(ckpt, optimizer)
        self.runtime.refresh()
        return loaded

    def figures(self, optimizer, step_s, peak):
        if not self.over_budget_told:
            self.over_budget_told = told_over_budget(self.runtime.plan, peak.get("peak_gpu_bytes"))
        return offload_figures(self.runtime, optimizer, step_s)

    def close(self) -> None:
        self.runtime.close()  # every copy done: the host weights are final


def make_executor(config: TrainConfig, dist: Dist | None) -> tuple[LocalExecutor, TrainConfig]:
    """The executor of the run `config` describes (dist: this process's place under torchrun), and
    the config it trains with: a plan the planner made among chunk sizes sets the chunk size and
    where the pages live, and the attention outputs pass 1 keeps."""
    plan = plan_for_run(config)
    if dist is not None:
        return ShardedExecutor(config, dist), config
    if plan is None:
        return LocalExecutor(config), config
    chosen = plan.run_settings()
    config = config.with_flat(**chosen) if chosen else config
    return OffloadExecutor(config, plan), config
