"""Stage two: train a student against a teacher cache, in one readable loop.

Run directory (`out`):
  run.json            the resolved config (flat names: TrainConfig.to_flat()), the cache's id and
                      temperature, the student's identity and tokenizer hash, and with offload the
                      plan the run trains with (offload_plan: OffloadPlan.to_dict(), its predictions;
                      with --chunk-candidates the config's chunk_tokens, kv_offload and offload_pages
                      are the plan's choice, and its chunk_choices every candidate considered; a plan
                      that keeps the attention outputs of fewer chunks sets keep_attention_chunks)
  metrics.jsonl       {"kind": "train", step, loss, kl, lr, grad_norm, tokens, tok_per_s,
                      optimizer_state_bytes, epoch, and on a GPU peak_gpu_bytes: the most
                      allocated since the previous row, and peak_gpu_reserved_bytes: the most the
                      caching allocator held, capped at --gpu-memory when given}; with offload also
                      offload_step_s (mean seconds of the window's steps, evaluation and checkpoints
                      left out),
                      offload_predicted_step_s / _gpu_peak_bytes / _host_peak_bytes (the plan's),
                      offload_phase_s and offload_predicted_phase_s (the last step's phases, measured and
                      predicted: student/planner/solve.py's PHASES)
                      and offload_host_bytes (what the offloaded layers hold on the host); with a ReLU-gated (sparse FFN) student also
                      l1 (mean over layers of sum over d_ff of |h|, mean over tokens) and, per layer
                      over the steps since the previous row, ffn_nnz (mean non-zeros of h per token),
                      ffn_sparsity (1 - nnz / d_ff), ffn_dead (share of neurons zero on every token;
                      counted over the real tokens of the batches, padding left out),
                      ffn_overflow_rows / ffn_fallback_rows (kernel counts), ffn_reinit (gate
                      rows moved by dead_reinit), ffn_kernel (with sparse_kernel "twell");
                      {"kind": "eval", step, kl, ce, ppl, top1, tokens (+ ffn_nnz, ffn_sparsity,
                      ffn_dead for a sparse student)}: with several caches the mean over them at
                      --cache-weights (an --ensemble: against the teachers' mixture), and
                      {"kind": "cache_eval", step, cache: its place in --cache or --ensemble, the
                      same figures} for each; and {"kind": "change", step, changes: {name:
                      [old, new]}} where a rerun continued the run with other settings; {"kind":
                      "stop", step, reason: "non-finite", message} when a non-finite loss stopped the
                      run (a rerun resumes from its checkpoint and drops the row)
  run.pid             the process training the run (student/run_owner.py), which holds an flock on it
                      for the run's life (a second trainer into the same directory is refused),
                      removed when it returns or raises; one a killed process left is taken over
  initial_eval.json   the step-0 student on the evaluation sequences
  eval.json           initial / final student and teacher reference at the end (several caches: also
                      each cache's, "caches")
  checkpoints/, student/   see student/checkpoint.py

Rerunning `train` with the same config resumes from the last checkpoint; with deterministic=True
on the CPU the losses equal those of an uninterrupted run bit for bit. A rerun may change the
settings in CHANGEABLE (the schedule, more steps, the optimizer's hyperparameters, the sparse
FFN's policy, where the cache lives): the run continues from its checkpoint under the new ones.
Settings that change the model or the data make it another run, refused.

The config is student/train_config.py's (torch-free, for the CLI); a step's parts are
student/step.py's; where the step runs (one process, FSDP2, planned offload) is the executor's
(student/executors.py), chosen once: the loop below does not ask which.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from distill.configs import ConfigError
from distill.errors import DistillUserError
from distill.files import atomic_write_json, distill_home
from student import run_owner
from student.checkpoint import RunDirError, checkpoints, latest_checkpoint, remove_stale, rewind
from student.data import CacheBatches, Prefetcher, load_tokenizer
from student.distributed import Dist, check_config, setup, teardown, world_from_env
from student.evaluate import EvalResult, evaluate_student, kl_note, teacher_reference, token_bytes_of
from student.executors import LocalExecutor, make_executor
from student.host_heap import keep_freed_pieces
from student.host_threads import one_openmp_team
from student.mixture import RunCaches, open_run_caches
from student.offload.run import caps_allocator, cuda_index, over_cap_message
from student.optim.build import build_optimizer, load_state_keeping_settings, state_bytes
from student.run_dir import MetricsLog, check_run_dir, diverged_message, eval_row, make_run_dir
from student.schedule import lr_factor
from student.step import autocast_dtype, initial_student, model_policy, peak_gpu_bytes, resolve
from student.train_config import CHANGEABLE, TrainConfig
from teacher_cache.identity import tokenizer_info
from teacher_cache.verify import check_shards

__all__ = ["CHANGEABLE", "NonFiniteLossError", "RunDirError", "TrainConfig", "TrainReport", "train"]

logger = logging.getLogger(__name__)


class NonFiniteLossError(DistillUserError):
    """The loss or the gradient norm became NaN or infinite."""


@dataclass
class TrainReport:
    run_dir: str
    student_dir: str
    steps: int  # steps done in total
    resumed_from: int  # step of the checkpoint this call started from (0: fresh)
    final_loss: float | None  # loss of the last step this call ran (None if it ran none)
    initial_eval: EvalResult | None  # the step-0 student (None when a resumed run has no record of it)
    final_eval: EvalResult
    teacher_eval: EvalResult  # the teacher itself, from the cache
    # several caches: (cache, the final student's evaluation on its held-out sequences, the teacher's
    # there) each; the two above are their means at the --cache-weights. One cache: empty.
    cache_evals: list[tuple[str, EvalResult, EvalResult]] = dataclasses.field(default_factory=list)


def train(config: TrainConfig, progress: bool = True, *, resume_from: int | None = None,
          on_step: Callable[[int], None] | None = None) -> TrainReport:
    """Train (or resume) the run described by `config`; returns what it did and the final evaluation.
    resume_from: continue from the kept checkpoint of this step instead of the latest (the newer
    ones, and a final student, are deleted). on_step: called with the step's number after each
    step, its metrics and its checkpoint are written (tests stop the process there, as a kill would)."""
    schedule = config.schedule
    if schedule.warmup_steps is not None and schedule.warmup_steps >= schedule.steps:  # the default scales with the run
        logger.warning("warmup_steps %d >= steps %d: the whole run is warmup and the learning rate never decays",
                       schedule.warmup_steps, schedule.steps)
    config = resolve(config)
    with _environment(config, progress) as dist:
        out, main = Path(config.out), dist is None or dist.main
        if resume_from is not None and not (out / "run.json").exists():
            raise RunDirError(f"--resume-from {resume_from}: {out} holds no run to resume")
        random.seed(config.seed), np.random.seed(config.seed), torch.manual_seed(config.seed)
        caches, tok, config, token_bytes = _open_cache(config)
        reader, cross = caches.first.reader, caches.first.cross  # the caches share tokenizer and targets
        executor, config = make_executor(config, dist)
        model, identity = initial_student(config, executor.model_device)
        if model.config.vocab_size < tok["vocab_size"]:
            raise DistillUserError(f"--student: the student's vocab size {model.config.vocab_size} is smaller than its "
                                   f"tokenizer's {tok['vocab_size']}; use a student built for this tokenizer, or prune one "
                                   "from the teacher with --tokenizer")
        several = {"cache_ids": [s.reader.manifest.cache_id for s in caches.sources]} if len(caches.sources) > 1 \
            else {}
        run = {"config": config.to_flat(), "cache_id": reader.manifest.cache_id, **several,
               "cache_temperature": reader.manifest.spec.targets.temperature, "student": identity,
               "tokenizer_hash": tok["hash"], "cross_tokenizer": cross is not None}
        changes = executor.run_first(lambda: _prepare_run_dir(out, run, resume_from))
        executor.place(model)  # before the optimizer sees the parameters
        run.update(executor.run_info())
        optimizer = build_optimizer(model, config.optim, config.device)
        data = caches.stream(config.batch_size, seq_len=config.seq_len, seed=config.seed,
                             pin_memory=config.device.startswith("cuda"), part=executor.data_part,
                             lru_shards=config.loader_shards)
        policy = model_policy(config, model, executor.reduce)
        step, last_saved = 0, None  # last_saved: (checkpoint, the loss of its step)
        if (ckpt := latest_checkpoint(out)) is not None:
            step, last_saved = _resume(ckpt, executor, optimizer, data, policy, config.schedule.steps)
        resumed_from, steps = step, config.schedule.steps
        cache_temperature = run["cache_temperature"]

        def evaluate(at_step: int) -> tuple[EvalResult, list[EvalResult]]:
            """(the evaluation: against an ensemble's mixture, else the mean over caches at the weights;
            each cache's, when several: an ensemble's teachers one by one). Every rank evaluates every
            sequence (the forward is collective)."""
            on = lambda source, batches: evaluate_student(
                model, source.reader, source.eval_idx, batch_size=config.batch_size, device=config.device,
                seq_len=config.seq_len, autocast_dtype=autocast_dtype(config), long=config.long,
                progress=progress and main, token_bytes=token_bytes, batches=batches)
            with executor.evaluating():
                result, each = caches.evaluate(on)
            if main:
                logger.info("eval at step %d: %s", at_step, result.summary())
            return result, each

        def record(at_step: int) -> tuple[EvalResult, list[EvalResult]]:
            """evaluate(), its metrics rows written: "eval", and with several caches a "cache_eval" row each."""
            result, each = evaluate(at_step)
            metrics.write({"kind": "eval", "step": at_step, **result.to_dict()})
            for place, one in enumerate(each):
                metrics.write({"kind": "cache_eval", "step": at_step, "cache": place, **one.to_dict()})
            return result, each

        metrics = MetricsLog(out / "metrics.jsonl", step, main)
        if changes:
            logger.info("continuing from step %d with %s", step,
                        "; ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in changes.items()))
            metrics.write({"kind": "change", "step": step, "changes": changes})
        if main:
            atomic_write_json(out / "run.json", run)
        initial = _initial_eval(out, step, record, main)
        final_each: list[EvalResult] = []  # each cache's newest evaluation (several caches)

        model.train()
        batches = Prefetcher(data)
        loss_value, window_tokens, window_start = None, 0, time.perf_counter()
        window_step_s, window_steps = 0.0, 0  # time in the steps themselves (offload rows)
        peak_gpu_bytes(config.device)  # the first row's window opens here: loading's and the profile's peaks are no step's
        bar = tqdm(total=steps, initial=step, disable=not (progress and main), desc="train", unit="step")
        with bar, metrics, batches:
            while step < steps:
                step_start = time.perf_counter()
                lr = config.optim.lr * lr_factor(step, config.schedule)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                loss_sum, kl_sum, tokens = 0.0, 0.0, 0
                for _ in range(config.grad_accum):
                    batch = next(batches)
                    loss, kl = executor.backward(batch, cache_temperature=cache_temperature, policy=policy)
                    loss_sum, kl_sum, tokens = loss_sum + loss.item(), kl_sum + kl.item(), tokens + batch.num_tokens
                loss_sum, kl_sum, tokens = executor.totals(loss_sum, kl_sum, tokens)
                grad_norm = executor.clip_grads(config.optim.clip_grad if config.optim.clip_grad > 0 else math.inf)
                loss_value = loss_sum / config.grad_accum
                if not (math.isfinite(loss_value) and math.isfinite(grad_norm)):
                    message = diverged_message(step + 1, loss_value, grad_norm, last_saved, checkpoints(out))
                    metrics.write({"kind": "stop", "step": step + 1, "reason": "non-finite", "message": message})
                    raise NonFiniteLossError(message)
                executor.optimizer_step(optimizer)
                optimizer.zero_grad(set_to_none=True)
                step += 1
                window_step_s, window_steps = window_step_s + time.perf_counter() - step_start, window_steps + 1
                policy.end_step(model, step, config.grad_accum, tokens)
                window_tokens += tokens
                bar.update(1)
                bar.set_postfix(loss=f"{loss_value:.4f}")
                if step % config.log_every == 0 or step == steps:
                    elapsed, peak = time.perf_counter() - window_start, peak_gpu_bytes(config.device)
                    metrics.write({"kind": "train", "step": step, "loss": loss_value, "kl": kl_sum / config.grad_accum,
                                   "lr": lr, "grad_norm": grad_norm, "tokens": tokens,
                                   "tok_per_s": window_tokens / max(elapsed, 1e-9),
                                   "optimizer_state_bytes": state_bytes(optimizer), "epoch": batches.epoch, **peak,
                                   **policy.metrics(model),
                                   **executor.figures(optimizer, window_step_s / window_steps, peak)})
                    window_tokens, window_start, window_step_s, window_steps = 0, time.perf_counter(), 0.0, 0
                if (config.eval_every and step % config.eval_every == 0) or step == steps:
                    final_each = record(step)[1]
                if (config.save_every and step % config.save_every == 0) or step == steps:
                    saved = executor.save(out, step, optimizer, {"loss": loss_value, **policy.state_dict(model)},
                                          batches.state_dict())
                    last_saved = (saved, loss_value)
                if on_step is not None:
                    on_step(step)

        # The loop's last step always evaluates; a rerun of a finished run evaluates again.
        if resumed_from == step:
            final, final_each = evaluate(step)
        else:
            final = EvalResult.from_dict(eval_row(metrics.path, step))
        teacher, teachers = caches.teacher(lambda source, batches: teacher_reference(
            source.reader, source.eval_idx, seq_len=config.seq_len, batches=batches,
            token_bytes=token_bytes if source.cross is None else source.cross.aligner.teacher.lengths))
        cache_evals = list(zip(config.ensemble or config.cache, final_each, teachers))
        # a student of another tokenizer: what alignment met in the batches this process built
        alignment = {"alignment": dict(data.counts)} if cross is not None else {}
        by_cache = {"caches": [{"cache": path, "weight": w, "final": one.to_dict(), "teacher": t.to_dict()}
                               for (path, one, t), w in zip(cache_evals, caches.weights)]} if cache_evals else {}
        if main:
            atomic_write_json(out / "eval.json", {"step": step, "initial": initial.to_dict() if initial else None,
                                                  "final": final.to_dict(), "teacher": teacher.to_dict(),
                                                  "kl_note": kl_note(reader, cross is not None), **by_cache,
                                                  **alignment})
            if alignment:
                logger.info("cross-tokenizer: %s", ", ".join(f"{k} {v:,}" for k, v in sorted(data.counts.items())))
        executor.close()
        executor.save_student(out / "student", config.tokenizer, last_saved[0])  # its weights are the model's
        return TrainReport(str(out), str(out / "student"), step, resumed_from, loss_value, initial, final, teacher,
                           cache_evals)


@contextlib.contextmanager
def _environment(config: TrainConfig, progress: bool):
    """Around a run: this process's place under torchrun (yielded: a Dist, or None for one process),
    deterministic algorithms, log lines above the progress bar, and, when the run caps torch's
    allocator at --gpu-memory, a step out of memory said in one line and the cap lifted after. For
    the optimizers' CPU steps, for the rest of the process: the host heap keeps freed pieces
    (student.host_heap) and CPU ops run in parallel on the main thread only (student.host_threads)."""
    keep_freed_pieces()
    dist = _join_processes(config)
    one_openmp_team(config.device)  # on this process's device (torchrun's rank set it)
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    capped = caps_allocator(config)  # the offload executor caps it once the run has planned
    was_fraction = torch.cuda.get_per_process_memory_fraction(cuda_index(config.device)) if capped else None
    if config.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    show = progress and (dist is None or dist.main)
    try:
        with logging_redirect_tqdm() if show else contextlib.nullcontext():
            yield dist
    except torch.OutOfMemoryError as error:
        if not capped:
            raise
        raise DistillUserError(over_cap_message(config.offload.gpu_memory)) from error
    finally:
        torch.use_deterministic_algorithms(was_deterministic)
        if capped:
            torch.cuda.set_per_process_memory_fraction(was_fraction, cuda_index(config.device))
        if dist is not None:
            teardown()
        if dist is None or dist.main:  # rank 0 wrote it; other ranks reading it would race its removal
            run_owner.release(Path(config.out))


def _join_processes(config: TrainConfig) -> Dist | None:
    """Under torchrun with more than one process: check the config, join the process group and
    return this process's Dist; None for one process."""
    dist = world_from_env()
    if dist is not None:
        check_config(config, dist)
        setup(dist, config.device)
    return dist


def _open_cache(config: TrainConfig) -> tuple[RunCaches, dict, TrainConfig, np.ndarray | None]:
    """(the run's caches, the student's tokenizer identity, the config at the distillation temperature,
    the bytes of the student's token ids or None: evaluations then have no bits per byte), after
    refusing caches that cannot be mixed or ensembled (student/mixture.py), a cache of another
    tokenizer that cannot teach this one, a temperature the loss cannot train at, or a damaged shard
    (every shard's size and checksum, before anything is written)."""
    tokenizer = load_tokenizer(config.tokenizer)
    tok = tokenizer_info(tokenizer)
    caches = open_run_caches(config, tokenizer, maps_folder=distill_home() / "vocab-maps")
    targets = caches.first.reader.manifest.spec.targets
    config.loss.check_cache_temperature(targets.temperature, kind=targets.kind)
    for cache in config.ensemble or config.cache:
        check_shards(cache)
    cross = caches.first.cross
    token_bytes = cross.aligner.student.lengths if cross is not None else token_bytes_of(config.tokenizer, tokenizer)
    return (caches, tok, config.with_flat(temperature=config.loss.distillation_temperature(targets.temperature)),
            token_bytes)


def _prepare_run_dir(out: Path, run: dict, resume_from: int | None) -> dict:
    """Claim `out` for this run (the lock first, so that a second trainer is refused before it reads or
    writes anything there; then refusing another run's directory), rewind it to `resume_from` when
    given, clear what a killed run left half-written; the CHANGEABLE settings a rerun changed."""
    make_run_dir(out)
    run_owner.claim(out)
    changes = check_run_dir(out, run)
    if resume_from is not None:
        rewind(out, resume_from)
    remove_stale(out)
    return changes


def _resume(ckpt: Path, executor: LocalExecutor, optimizer, data: CacheBatches, policy, steps: int):
    """Load checkpoint `ckpt` into the run's parts; (its step, (ckpt, the loss of its step))."""
    state, data_state = executor.load(ckpt, optimizer)
    step = int(state["step"])
    if steps < step:
        raise ConfigError("steps", f"is {steps}, below the run's last checkpoint at step {step}; give at least "
                                   "that many (more steps extend a finished run)")
    if "optimizer" in state:  # a sharded checkpoint's was loaded with the model
        load_state_keeping_settings(optimizer, state["optimizer"])
    data.load_state_dict(data_state)
    policy.load_state_dict(state, executor.model)
    return step, (ckpt, state.get("loss"))


def _initial_eval(out: Path, step: int, record, main: bool) -> EvalResult | None:
    """The step-0 student's evaluation: run and recorded (`record`: the trainer's) at step 0, read back
    on a resume."""
    if step == 0:
        initial = record(0)[0]
        if main:
            atomic_write_json(out / "initial_eval.json", initial.to_dict())
        return initial
    if (out / "initial_eval.json").exists():
        return EvalResult.from_dict(json.loads((out / "initial_eval.json").read_text()))
    return None
