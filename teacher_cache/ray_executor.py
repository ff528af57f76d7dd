"""Stage one on a Ray cluster (`distill cache-teacher --executor ray`): one Ray task per shard.

The driver (the `distill` process) claims the cache as a one-process build does (holding
CACHE/LOCK for the whole build, on behalf of its tasks), submits one task per missing shard and
writes the manifest last. A task scores its shard's sequences and writes the shard through the
same code as the local path (``build.score_and_write``: an atomic file, its checksum) and returns
its ``ShardInfo``. The teacher is loaded once per Ray worker process and kept there for the
build's later tasks. A task whose worker process dies (killed, out of memory, node lost) is run
again by Ray (``max_retries``): the build loses at most the shards in flight on that worker, and
the new attempt first removes the partial temp files of its shard. So shards are a pure function
of their sequences whatever ran them, and the cache equals a one-process build.

Every node must see the cache folder (a shared filesystem, or an fsspec URL such as s3://...),
the teacher folder at the same path, and an install of this package.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from distill.errors import DistillUserError
from teacher_cache.build import BuildReport, score_and_write
from teacher_cache.errors import CacheError
from teacher_cache.location import cache_location
from teacher_cache.writer import CacheLock, CacheWriter

log = logging.getLogger(__name__)

# Tasks submitted and not finished. Above the cluster's task slots, so a slot that frees up gets
# its next shard at once and an autoscaler sees the demand; bounded, so a corpus of millions of
# shards is not all in Ray's object store at once.
_MIN_IN_FLIGHT = 64


def import_ray():
    """The ray module, or a one-line error naming the extra that installs it."""
    try:
        import ray
    except ImportError:
        raise DistillUserError("--executor ray needs the ray package, which is not installed: "
                               "pip install 'distill[ray]' (or pip install ray)") from None
    return ray


@dataclass(frozen=True)
class RayConfig:
    """How the shard tasks run on the cluster."""

    address: str | None = None  # None: RAY_ADDRESS, else a running local cluster, else a new local one
    max_retries: int = 3  # attempts after the first for a task whose worker process died
    cpus_per_task: int = 1  # CPUs a task of a CPU teacher reserves (and its torch threads)
    connect_timeout_s: float = 10.0  # how long a host:port address may take to answer


@dataclass(frozen=True)
class RayCluster:
    """A Ray cluster this process is connected to: its resources and the task settings."""

    config: RayConfig
    gpus: float
    cpus: float

    def task_device(self, device: str) -> str:
        """The teacher's device inside a task: "cuda" (the GPU Ray assigns to the task) or "cpu".

        device: the --device asked for; "auto" is a GPU when the cluster has any."""
        if device == "cpu" or (device == "auto" and not self.gpus):
            return "cpu"
        if device not in ("auto", "cuda"):
            raise DistillUserError(f"--device must be auto, cuda or cpu with --executor ray (each task gets the "
                                   f"GPU Ray assigns it), got {device!r}")
        if not self.gpus:
            raise DistillUserError("--device is 'cuda' but the Ray cluster has no GPU; use --device cpu or auto, "
                                   "or connect to a cluster with GPUs (--ray-address)")
        return "cuda"

    def teacher(self, make: Callable, description: dict, vocab_size: int, device: str,
                gpus_per_task: int = 1, wrap_teacher: Callable | None = None) -> "RayTeacher":
        """The stand-in for the backend in ``build_cache``. make: builds the real one in a task
        (picklable, e.g. a functools.partial of ``make_backend``); device: ``task_device``'s;
        gpus_per_task: GPUs one teacher spans (vLLM's tensor parallelism); wrap_teacher:
        ``wrap_teacher(backend, shard_index) -> backend``, applied in each task to the worker's
        teacher for that task's shard only (picklable; a seam for tests to inject faults), or None."""
        return RayTeacher(self, make, description, vocab_size, device, gpus_per_task, wrap_teacher=wrap_teacher)


@contextlib.contextmanager
def ray_session(config: RayConfig) -> Iterator[RayCluster]:
    """Connect to the Ray cluster (or use the one this process is already connected to, as a
    test's ``ray.init`` does); disconnect at the end only if this call connected."""
    ray = import_ray()
    connected_here = not ray.is_initialized()
    if connected_here:
        address = config.address or os.environ.get("RAY_ADDRESS") or None
        _check_reachable(address, config.connect_timeout_s)
        try:
            ray.init(address=address, logging_level=logging.WARNING)
        except (ConnectionError, RuntimeError, ValueError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise DistillUserError(f"cannot connect to the Ray cluster at {address or 'this machine'}: {first}; "
                                   "check --ray-address (or RAY_ADDRESS)") from None
    elif config.address:
        log.warning("this process is already connected to a Ray cluster; --ray-address %s is not used",
                    config.address)
    try:
        resources = ray.cluster_resources()
        yield RayCluster(config, gpus=float(resources.get("GPU", 0)), cpus=float(resources.get("CPU", 0)))
    finally:
        if connected_here:
            ray.shutdown()


def _check_reachable(address: str | None, timeout_s: float) -> None:
    """A host:port address must accept a connection: ray.init waits on one that does not, for long."""
    if not address or "://" in address or address in ("auto", "local") or ":" not in address:
        return  # ray:// (Ray Client) and "auto" fail by themselves
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except (OSError, ValueError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e) or type(e).__name__
        raise DistillUserError(f"cannot reach the Ray cluster at {address} ({why}); start it (`ray start --head` "
                               "on its head node) or fix --ray-address (or RAY_ADDRESS)") from None


@dataclass(frozen=True)
class _ShardJob:
    """What one task needs: the cache, its spec, the shard and the teacher's recipe."""

    out: str  # absolute path or URL of the cache
    spec: object  # the driver writer's CacheSpec
    config: object  # the build's CacheConfig
    index: int
    sequences: list[np.ndarray]  # the shard's sequences (int32 [L_i] each)
    num_sequences: int  # in the whole cache
    make: Callable  # builds the teacher backend
    build_id: str  # the teacher a worker keeps belongs to this build
    wrap_teacher: Callable | None = None  # (backend, index) -> the backend that scores this shard


@dataclass
class RayTeacher:
    """Stands in for the teacher backend on the driver: the manifest's teacher fields and the
    vocabulary come from the teacher folder; the teacher itself runs in the Ray tasks, and
    ``build_cache`` hands the missing shards to ``write_shards`` instead of scoring them here."""

    cluster: RayCluster
    make: Callable
    description: dict
    vocab_size: int
    device: str  # "cuda" (a task reserves gpus_per_task GPUs) or "cpu"
    gpus_per_task: int = 1
    # (backend, shard index) -> backend, applied in each task (RayCluster.teacher); None: as made
    wrap_teacher: Callable | None = None
    build_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    @property
    def name(self) -> str:
        """The backend the tasks run ("hf" | "vllm")."""
        return self.description["backend"]

    @property
    def can_sample(self) -> bool:
        """Whether the tasks' backend draws sampled targets (as ``build.check_backend_can_sample``
        decides by name before a backend exists)."""
        return self.name == "hf"

    def describe(self) -> dict:
        return dict(self.description)

    def score(self, sequences, k):
        raise TypeError("a RayTeacher scores whole shards in Ray tasks (write_shards), not sequences here")

    def close(self) -> None:
        pass  # the workers' teachers go with their processes when the driver disconnects

    def _task_options(self) -> dict:
        config = self.cluster.config
        resources = {"num_gpus": self.gpus_per_task} if self.device == "cuda" else {
            "num_cpus": config.cpus_per_task}
        # retry_exceptions off: an error raised by the task (a bad input, a full disk) would fail
        # again; only a dead worker is retried.
        return {**resources, "max_retries": config.max_retries, "retry_exceptions": False}

    def _slots(self) -> int:
        if self.device == "cuda":
            return max(1, int(self.cluster.gpus // self.gpus_per_task))
        return max(1, int(self.cluster.cpus // self.cluster.config.cpus_per_task))

    def write_shards(self, sequences, lengths, todo: list[int], config, writer, report, progress: bool) -> None:
        """Write the shards ``todo`` in Ray tasks and record their infos in ``writer`` (whose
        ``finalize`` then writes the manifest). Shards whose task failed are not written; the
        others in flight are let finish (complete work), then a one-line CacheError says which
        failed, so a rerun resumes with those."""
        ray = import_ray()
        # max_calls=0: keep the worker process (and its teacher) between tasks; Ray's default for
        # a task that reserves a GPU is a new process per task, which would reload the teacher.
        task = ray.remote(max_calls=0)(_write_shard_task).options(**self._task_options())
        out = writer.path if "://" in str(writer.path) else Path(writer.path).resolve()
        shard_size = config.shard_size
        queue, pending, failed = deque(todo), {}, []
        loads: dict[str, int] = {}  # worker process ("host:pid") -> teachers loaded there
        bar = tqdm(total=int(sum(lengths[i * shard_size:(i + 1) * shard_size].sum() for i in todo)), unit="tok",
                   unit_scale=True, desc=f"scoring ({len(todo)} shards on Ray)", disable=not progress)
        try:
            while queue or pending:
                while queue and not failed and len(pending) < max(_MIN_IN_FLIGHT, 4 * self._slots()):
                    index = queue.popleft()
                    job = _ShardJob(out=str(out), spec=writer.spec, config=config, index=index,
                                    sequences=sequences[index * shard_size:(index + 1) * shard_size],
                                    num_sequences=len(sequences), make=self.make, build_id=self.build_id,
                                    wrap_teacher=self.wrap_teacher)
                    pending[task.remote(job)] = index
                if not pending:
                    break
                (ref,), _ = ray.wait(list(pending), num_returns=1)
                index = pending.pop(ref)
                try:
                    done = ray.get(ref)
                except ray.exceptions.RayError as e:
                    failed.append((index, _task_failure(e, self.cluster.config.max_retries)))
                    continue
                _record(index, done, writer, report, loads)
                bar.update(done["tokens"])
        finally:
            bar.close()
        report.extra["ray"] = {"workers": sorted(loads), "teacher_loads": sum(loads.values())}
        if failed:
            index, why = failed[0]
            others = f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""
            raise CacheError(f"shard {index}{others} of {writer.path} failed on the Ray cluster: {why}; the shards "
                             "written are kept: rerun the same command to resume")


def _record(index: int, done: dict, writer, report, loads: dict[str, int]) -> None:
    """A task's result into the driver's writer (its ShardInfo, so finalize need not reread the
    shard) and report."""
    if done["info"] is not None:
        writer.record_shards({index: done["info"]})
    report.written_shards += 1
    report.tokens_scored += done["tokens"]
    report.teacher_seconds += done["teacher_seconds"]
    report.writer_seconds += done["writer_seconds"]
    loads[done["worker"]] = loads.get(done["worker"], 0) + done["loaded"]


def _task_failure(error, max_retries: int) -> str:
    """One line for a task that failed: its own exception, or its worker's deaths."""
    ray = import_ray()
    if isinstance(error, ray.exceptions.RayTaskError):
        cause = error.cause if error.cause is not None else error
        text = str(cause).strip().splitlines()
        return f"{type(cause).__name__}: {text[0] if text else ''}"
    if isinstance(error, (ray.exceptions.WorkerCrashedError, ray.exceptions.NodeDiedError)):
        return f"its worker process died at each of its {max_retries + 1} attempts ({type(error).__name__})"
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


# The teacher of this Ray worker process, with the build it belongs to: loaded by the first task
# of a build that runs here and kept for the next ones (a new build replaces it).
_WORKER_TEACHER: dict[str, object] = {}


def _worker_teacher(job: _ShardJob) -> tuple[object, bool]:
    """(this worker's teacher for the job's build, whether this call loaded it)."""
    if job.build_id in _WORKER_TEACHER:
        return _WORKER_TEACHER[job.build_id], False
    for old in _WORKER_TEACHER.values():
        old.close()
    _WORKER_TEACHER.clear()
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a worker's bars would interleave on the driver's terminal
    _WORKER_TEACHER[job.build_id] = job.make()
    return _WORKER_TEACHER[job.build_id], True


def _write_shard_task(job: _ShardJob) -> dict:
    """A Ray task: score shard ``job.index`` and write it; its ShardInfo and where the time went."""
    out = cache_location(job.out)
    lock = CacheLock(out, _HeldByDriver(), created=False, shared=True)
    # owned_shards: checks the manifest's identity and removes only this shard's temp files (an
    # earlier attempt's, if its worker died mid-shard)
    writer = CacheWriter(out, job.spec, lock=lock, owned_shards=[job.index])
    try:
        if job.index in writer.done_shards():  # an attempt placed it, then died before returning
            return {"info": None, "tokens": 0, "teacher_seconds": 0.0, "writer_seconds": 0.0, "worker": _worker_name(),
                    "loaded": 0}
        backend, loaded = _worker_teacher(job)
        if job.wrap_teacher is not None:
            backend = job.wrap_teacher(backend, job.index)
        start = job.index * job.config.shard_size
        # The cache's sequences as build's slicing by global index sees them: only this shard's are here.
        sequences = [None] * start + list(job.sequences)
        lengths = np.zeros(job.num_sequences, dtype=np.int64)
        lengths[start:start + len(job.sequences)] = [len(s) for s in job.sequences]
        report = BuildReport(cache_dir=out, cache_id=writer.cache_id)
        score_and_write(sequences, lengths, [job.index], backend, job.config, writer, report, False)
        return {"info": writer.written[job.index], "tokens": report.tokens_scored,
                "teacher_seconds": report.teacher_seconds, "writer_seconds": report.writer_seconds,
                "worker": _worker_name(), "loaded": int(loaded)}
    finally:
        writer.close()


def _worker_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


class _HeldByDriver:
    """The lock "file" of a task's writer: the driver holds CACHE/LOCK for the whole build."""

    def close(self) -> None:
        pass
