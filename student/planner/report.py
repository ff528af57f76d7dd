"""`distill plan`'s report: a plan as tables and lines a person reads (student/planner/solve.py makes
the plan; this only prints it)."""

from __future__ import annotations

from student.long_context.config import kept_chunks
from student.planner.costs import PHASES
from student.planner.peaks import gpu_peak_terms, held_activation_bytes
from student.planner.table import CostTable
from student.offload.plan import OffloadPlan
from student.offload.config import format_bytes

__all__ = ["plan_table"]


def plan_table(plan: OffloadPlan, costs: CostTable, device: str = "cuda") -> str:
    """The plan as a table a person reads: per layer its decisions, bytes and predicted time; then
    the step's totals against the budgets. device: where the step was profiled; on "cpu" the plan's
    GPU side (--gpu-memory) is the CPU's memory, and the table calls it the device."""
    import io

    from rich.console import Console
    from rich.table import Table

    gpu = "device" if device == "cpu" else "GPU"
    size = lambda n: format_bytes(n) if n else "-"
    update_on = {"gpu": gpu, "cpu": "host" if device == "cpu" else "CPU"}[plan.optimizer]
    home = gpu if plan.embedding == "gpu" else "host"
    embedding = f", input embedding on the {home}" if costs.embedding_bytes else ""
    table = Table(title=f"offload plan: prefetch depth {plan.prefetch_depth}, optimizer update on the "
                        f"{update_on}, {costs.micro_batches} micro-batch(es) a step{embedding}")
    for column in ("layer", "activation", "params", "states", "weights", "input", "kept for backward", "predicted"):
        table.add_column(column, justify="left" if column in ("activation", "params", "states") else "right")
    predicted = plan.predicted
    for i, (lp, c) in enumerate(zip(plan.layers, costs.layers)):
        kept = held_activation_bytes(c, lp.activation)
        seconds = f"{predicted.layer_s[i] * 1e3:.2f} ms" if predicted.layer_s else "-"
        table.add_row(str(i), lp.activation, lp.params, lp.states, size(c.weight_bytes), size(c.boundary_bytes),
                      size(kept), seconds)
    console = Console(file=io.StringIO(), width=110, color_system=None, force_terminal=False)
    console.print(table)
    if plan.chunk_choices:
        console.print(_choices_table(plan, gpu))
    budget = lambda n: f" of {format_bytes(n)}" if n is not None else ""
    pages = (f"offloaded to the host, page sets of {plan.offload_pages} on the {gpu}" if plan.kv_offload
             else f"every page on the {gpu}")
    lines = [f"predicted step time {predicted.step_s * 1e3:.2f} ms (compute, recompute and the transfers it "
             "cannot hide; per layer: all micro-batches)",
             "phases: " + ", ".join(f"{name} {predicted.phase_s.get(name, 0.0) * 1e3:.2f} ms" for name in PHASES),
             *([f"chunk-recurrent: {plan.chunk_tokens} tokens a chunk, {costs.chunks} chunks a micro-batch "
                f"(each a micro-batch above; pass 1 {costs.pass1_s * 1e3:.2f} ms a step, keeping the attention "
                f"outputs of {_kept_text(plan.keep_attention_chunks, costs.chunks)} for pass 2); {plan.resident_pages} "
                f"key/value pages resident on the {gpu} ({format_bytes(costs.kv_gpu_bytes)}; {pages}), "
                f"{format_bytes(costs.static_host_bytes - costs.loader_host_bytes)} on the host"]
               if plan.chunk_tokens is not None else []),
             f"peak {'GPU memory' if gpu == 'GPU' else 'memory on the device (CPU)'} "
             f"{format_bytes(predicted.gpu_peak_bytes)}{budget(plan.gpu_memory)}; "
             f"peak host memory {format_bytes(predicted.host_peak_bytes)}{budget(plan.host_memory)}"
             + (f" (the loader's batches and decoded shards {format_bytes(costs.loader_host_bytes)} of it)"
                if costs.loader_host_bytes else ""),
             _peak_text(gpu_peak_terms(costs, plan), gpu),
             f"measured: host->device {costs.h2d_bytes_per_s / 1e9:.1f} GB/s, device->host "
             f"{costs.d2h_bytes_per_s / 1e9:.1f} GB/s (both at once {costs.h2d_duplex_bytes_per_s / 1e9:.1f} and "
             f"{costs.d2h_duplex_bytes_per_s / 1e9:.1f}), host passes over gradients "
             f"{costs.host_bytes_per_s / 1e9:.1f} GB/s; static {gpu} bytes {format_bytes(costs.static_gpu_bytes)}, "
             f"the head's workspace {format_bytes(costs.loss_workspace_bytes)}"
             + (f"; compute timings x{costs.clock_factor:.3f} for the clock under a step's load"
                if costs.clock_factor != 1.0 else "")
             + (f"; the {gpu} budget keeps {format_bytes(costs.gpu_reserve_bytes)} beyond the peak for the allocator"
                if costs.gpu_reserve_bytes else "")]
    return console.file.getvalue() + "\n".join(lines)


def _peak_text(terms: dict[str, dict[str, int]], gpu: str) -> str:
    """The GPU peak's larger candidate (`gpu_peak_terms`) as a line: what it holds, the largest first."""
    when, parts = max(terms.items(), key=lambda item: sum(item[1].values()))
    held = sorted(((n, name) for name, n in parts.items() if n), reverse=True)
    return f"the {gpu} peak, at the {when.replace('_', ' ')}: " + ", ".join(
        f"{name.replace('_', ' ')} {format_bytes(n)}" for n, name in held)


def _kept_text(keep: int | None, chunks: int) -> str:
    kept = len(kept_chunks(chunks, keep))
    return f"all {kept} chunks before the last" if kept == chunks - 1 else f"the last {kept} of {chunks - 1} chunks"


def _choices_table(plan: OffloadPlan, gpu: str):
    """The chunk sizes and key/value residencies `choose_chunks` considered, the chosen one marked."""
    from rich.table import Table

    table = Table(title="chunk sizes and key/value pages considered (--chunk-candidates)")
    for column in ("chunk tokens", "key/value pages", f"pages on {gpu}", "attention kept", "input embedding",
                   "predicted step", f"peak {gpu}", "peak host", ""):
        table.add_column(column, justify="left" if column in ("key/value pages", "input embedding", "") else "right")
    key = (plan.chunk_tokens, bool(plan.kv_offload), plan.offload_pages, plan.resident_pages, plan.embedding)
    chosen = next((c for c in plan.chunk_choices
                   if (c.chunk_tokens, c.kv_offload, c.offload_pages, c.resident_pages, c.embedding) == key), None)
    for c in plan.chunk_choices:
        fits = c.step_s is not None
        table.add_row(str(c.chunk_tokens), f"offloaded, sets of {c.offload_pages}" if c.kv_offload else "resident",
                      "-" if c.resident_pages is None else str(c.resident_pages),
                      "all" if c.keep_attention_chunks is None else f"last {c.keep_attention_chunks}",
                      gpu if c.embedding == "gpu" else "host", f"{c.step_s * 1e3:.2f} ms" if fits else "-",
                      format_bytes(c.gpu_peak_bytes) if fits else "-",
                      format_bytes(c.host_peak_bytes) if fits else "-",
                      "chosen" if c is chosen else ("" if fits else "does not fit"))
    return table
