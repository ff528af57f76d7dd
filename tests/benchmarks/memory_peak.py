"""What is alive on the GPU at a step's peak, by where it was allocated.

One step runs under torch's allocator history (torch.cuda.memory._record_memory_history, Python
stacks); its trace is replayed to the event at which the allocated bytes are highest, and the
blocks alive then are summed by the place that allocated them: the innermost frame inside this
repository (else the innermost frame). Blocks allocated before the step (weights, states, the
key/value store's pools) are one line, "before the step". Python stacks only (cheap to record):
what the autograd engine allocates on its device thread outside a Python Function's backward has
no frames and is summed as "unknown". A row whose predicted GPU peak misses
the measured one then says which of the cost model's terms is off (student/planner/peaks.py's
`peaks` names them). bench_offload_gpu.py's --memory-peak writes one JSON file a variant.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

REPO = str(Path(__file__).resolve().parents[2])
BEFORE = "before the step"


def place_of(frames: list[dict], root: str = REPO) -> str:
    """`file:line function` of the innermost frame under `root` (torch lists frames innermost
    first), else of the innermost frame; "unknown" without frames."""
    inside = [f for f in frames if f.get("filename", "").startswith(root)]
    frame = (inside or frames or [None])[0]
    if frame is None:
        return "unknown"
    filename = frame["filename"][len(root) + 1:] if frame["filename"].startswith(root) else frame["filename"]
    return f"{filename}:{frame['line']} {frame['name']}"


def live_at_peak(events: list[dict], base_bytes: int, *, root: str = REPO, top: int = 40) -> dict:
    """Replay an allocator trace (torch's device_traces entries: "alloc" and "free_requested" change
    the allocated bytes, as torch's allocator counts them for max_memory_allocated; a block used on
    another stream is "free_completed" later, when that stream is past it, and its bytes stay
    reserved until then; other actions do not) from `base_bytes` allocated before it; returns the
    peak, the event it is reached at, and the blocks alive then summed by `place_of` (the largest
    `top` places; the bytes alive from before the trace as BEFORE)."""
    total, peak, at = base_bytes, base_bytes, -1
    for i, e in enumerate(events):
        if e["action"] == "alloc":
            total += e["size"]
        elif e["action"] == "free_requested":
            total -= e["size"]
        if total > peak:
            peak, at = total, i
    live: dict[int, tuple[int, str]] = {}
    freed_from_before = 0
    for e in events[:at + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], place_of(e.get("frames", []), root))
        elif e["action"] == "free_requested":
            if live.pop(e["addr"], None) is None:
                freed_from_before += e["size"]
    places: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for size, place in live.values():
        places[place][0] += size
        places[place][1] += 1
    rows = [{"place": place, "bytes": size, "blocks": n} for place, (size, n) in places.items()]
    rows.sort(key=lambda r: -r["bytes"])
    rows = [{"place": BEFORE, "bytes": base_bytes - freed_from_before, "blocks": None}] + rows[:top]
    return {"base_bytes": base_bytes, "peak_bytes": peak, "peak_event": at, "events": len(events),
            "live_at_peak": rows}


def reserved_by_stream(segments: list[dict]) -> list[dict]:
    """The allocator's segments after the step summed by the stream whose pool holds them (a block
    freed in one stream's pool is not reused by another's): reserved and allocated bytes, and
    how many segments, largest pool first."""
    pools: dict[int, list[int]] = defaultdict(lambda: [0, 0, 0])
    for segment in segments:
        pool = pools[segment["stream"]]
        pool[0] += segment["total_size"]
        pool[1] += segment["allocated_size"]
        pool[2] += 1
    rows = [{"stream": stream, "reserved": r, "allocated": a, "segments": n} for stream, (r, a, n) in pools.items()]
    return sorted(rows, key=lambda row: -row["reserved"])


def record_step(step, path: Path, *, max_entries: int = 2_000_000) -> dict:
    """Run `step()` once on the current CUDA device under the allocator's history and write
    `live_at_peak` of it (plus torch's max_memory_allocated over the step) to `path` as JSON."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(stacks="python", max_entries=max_entries)
    try:
        step()
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    result = live_at_peak(snapshot["device_traces"][torch.cuda.current_device()], base)
    result["max_memory_allocated"] = torch.cuda.max_memory_allocated()
    result["max_memory_reserved"] = torch.cuda.max_memory_reserved()
    result["reserved_by_stream"] = reserved_by_stream(snapshot["segments"])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    return result
