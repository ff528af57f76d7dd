"""The trainer's side of offloaded training (student/trainer.py calls these; student/offload/runtime.py is the
runtime, student/planner/solve.py the planner): the plan a run trains with, the figures its metrics rows
carry, the cap of torch's allocator at the budget the user gave, and the warning when a step's GPU peak
passes the plan's budget."""

from __future__ import annotations

import logging

import torch

from distill.configs import ConfigError
from student.offload.config import format_bytes
from student.offload.plan import OffloadPlan
from student.planner.solve import plan_for_training

__all__ = ["cap_allocator", "caps_allocator", "cuda_index", "offload_figures", "over_cap_message", "plan_for_run",
           "told_over_budget"]

logger = logging.getLogger(__name__)


def plan_for_run(config) -> OffloadPlan | None:
    """The plan the run trains with: a saved one, the planner's (auto), or None. A plan made for another
    chunk size is refused, unless the planner chose it (its chunk_choices) among candidates that
    held the run's chunk size (or the run gives none): train() then takes the plan's chunk settings."""
    candidates = config.offload.chunk_candidates
    if candidates is not None and config.offload.offload != "auto":
        raise ConfigError("chunk_candidates", f"is {candidates!r} with --offload {config.offload.offload}: the planner "
                                              "chooses among them with --offload auto (a saved plan holds its choice); "
                                              "add --offload auto or drop --chunk-candidates")
    if config.offload.offload == "none":
        return None
    if config.offload.offload == "auto":
        plan = plan_for_training(config)
    else:
        plan = OffloadPlan.load(config.offload.offload)
    chunk = config.long.chunk_tokens
    chosen_among = {c.chunk_tokens for c in plan.chunk_choices}
    adopted = chosen_among and (chunk is None or chunk in chosen_among)
    if plan.chunk_tokens is not None and plan.chunk_tokens != chunk and not adopted:
        ran = f"--chunk-tokens {chunk}" if chunk is not None else "whole sequences"
        raise ConfigError("offload", f"holds a plan made for --chunk-tokens {plan.chunk_tokens} but this run has "
                                     f"{ran}; train with the plan's --chunk-tokens, make the plan for this run "
                                     "(`distill plan`) or use --offload auto")
    keep = config.long.keep_attention_chunks
    if plan.keep_attention_chunks is not None and keep is not None and keep != plan.keep_attention_chunks:
        raise ConfigError("keep_attention_chunks", f"is {keep} but the plan keeps the attention outputs of "
                                                   f"{plan.keep_attention_chunks} chunks (its host memory counts "
                                                   "those); drop the option to train with the plan's, or make the "
                                                   "plan for this run (`distill plan`)")
    if plan.chunk_choices:
        logger.info("the plan chose --chunk-tokens %s, %s", plan.chunk_tokens,
                    f"--kv-offload with --offload-pages {plan.offload_pages}" if plan.kv_offload else "the pages resident")
    return plan


def offload_figures(runtime, optimizer, step_s: float) -> dict:
    """The row's offload figures; the phases are the last step's, measured beside the plan's predicted ones."""
    predicted = runtime.plan.predicted
    return {"offload_step_s": step_s, "offload_phase_s": runtime.phase_s(),
            "offload_predicted_step_s": predicted.step_s, "offload_predicted_phase_s": predicted.phase_s,
            "offload_predicted_gpu_peak_bytes": predicted.gpu_peak_bytes,
            "offload_predicted_host_peak_bytes": predicted.host_peak_bytes,
            "offload_host_bytes": runtime.host_bytes(optimizer)}


def told_over_budget(plan, peak_bytes: int | None) -> bool:
    """Warn (once: the caller stops asking after True) when the GPU peak passed the plan's budget:
    the cost model missed something the step holds, and the run may not fit beside other work."""
    if peak_bytes is None or plan.gpu_memory is None or peak_bytes <= plan.gpu_memory:
        return False

    logger.warning("the GPU peak %s passed the plan's --gpu-memory %s (it predicted %s): the planner's cost model "
                   "misses something this step holds; lower --gpu-memory by the difference to stay within the "
                   "budget", format_bytes(peak_bytes), format_bytes(plan.gpu_memory),
                   format_bytes(plan.predicted.gpu_peak_bytes))
    return True


def caps_allocator(config) -> bool:
    """Whether the run trains under `cap_allocator`: it offloads, on a GPU, with a --gpu-memory given."""
    return (config.device.startswith("cuda") and config.offload.offload != "none"
            and config.offload.gpu_memory is not None)


def cap_allocator(budget_bytes: int, device: str) -> None:
    """Cap torch's caching allocator at the --gpu-memory the user gave (train() lifts the cap when the
    run ends): the plan fits the tensors a step holds at once into the budget, and the cap holds the
    allocator's cached blocks to it too; past it the allocator hands cached blocks back before it
    reserves more, and a step that still cannot fit fails with out of memory instead of taking
    the rest of the device. The step's speed held under the cap in row
    `offload/qwen2-0.5b-T131072-gpu7.25GiB-chunks32768-kvoffload-capped/planned@a6a3681`."""
    index = cuda_index(device)
    total = torch.cuda.get_device_properties(index).total_memory
    torch.cuda.empty_cache()  # what is cached from before the run counts against the cap too
    torch.cuda.set_per_process_memory_fraction(min(budget_bytes / total, 1.0), index)


def cuda_index(device: str) -> int:
    """The index of a CUDA device string ("cuda" is the current device), as torch's memory-fraction
    calls take it."""
    index = torch.device(device).index
    return torch.cuda.current_device() if index is None else index


def over_cap_message(gpu_memory: str) -> str:
    """The one line a run capped by `cap_allocator` stops with when a step runs out of GPU memory."""
    return (f"a step ran out of GPU memory under --gpu-memory {gpu_memory}, at which torch's caching allocator is "
            "capped for the run: set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (its cached blocks then "
            "fragment less), or give a larger --gpu-memory")
