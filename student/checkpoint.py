"""Checkpoints of a stage-two run directory: save, load, find the latest, rewind to an older one,
and the final student folder. Imported by the trainer and by evaluation (never the other way).

  RUN/checkpoints/step-NNNNNN/  one checkpoint: what a resume needs to continue bit for bit
    model/                      the weights as an HF folder: model.safetensors (every parameter once,
                                in its training dtype: the fp32 masters, also under bf16 autocast; a
                                tied lm-head is the embedding, not saved twice) and config.json
    trainer_state.pt            the step, the loss of that step, the optimizer's state_dict (its
                                moments as the optimizer holds them: AdamW two fp32 tensors per
                                parameter, FOAM folded ones, 8-bit AdamW uint8 blocks and their fp32
                                scales; each tensor once), the RNG states (Python, NumPy, torch, CUDA:
                                a few KB) and, for a sparse FFN student, its statistics window and
                                each layer's kernel
    data.json                   the data position (epoch, offset in its order, seed, sequences)
  RUN/student/                  the final student: HF folder with the tokenizer's files

So a one-process AdamW checkpoint of P parameters is about 4P bytes of weights plus 8P of moments
(a 4-layer student pruned from SmolLM2-135M: 42.5M parameters, 170 MB + 340 MB). `--keep-checkpoints`
(TrainConfig.keep_checkpoints) says how many are kept: the newest, an older one deleted once a newer
one is written. In a one-process run the final student's model.safetensors is a hard link to the
last checkpoint's (the same weights: `save_student`), so the run holds those weights once; a
checkpoint whose linked weights file was written to afterwards (`cp` over RUN/student's writes into
it) is refused on resume, not loaded.

A run sharded over processes (student/distributed.py) writes instead, per checkpoint, dcp/ (the
model and optimizer shards through torch.distributed.checkpoint), config.json (the model's HF
config, for the shape check), trainer_state.pt without the optimizer, and data.json; either kind
resumes at any world size (`load_sharded_checkpoint`).

Every folder is written under a temp name and renamed into place (distill.files.atomic_dir), so a
kill leaves whole checkpoints and temp folders that `remove_stale_temps` clears on the next run.
The checkpoint folders are found by student/checkpoint_dirs.py, torch-free for `distill runs`; its
names are imported here too, where the trainer and student/run_dir.py take them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as tdist
from safetensors import safe_open

from distill.files import atomic_dir, atomic_write_text, remove_stale_temps
from student.checkpoint_dirs import RunDirError, checkpoint_step, checkpoints, latest_checkpoint
from student.distributed import load_full_into_sharded, load_sharded, save_sharded
from student.model import Student

__all__ = ["RunDirError", "checkpoints", "latest_checkpoint", "checkpoint_step", "remove_stale", "save_checkpoint",
           "load_checkpoint", "is_sharded_checkpoint", "save_sharded_checkpoint", "load_sharded_checkpoint", "rewind",
           "rewind_metrics", "save_student"]

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "tokenizer.model", "added_tokens.json", "chat_template.jinja", "generation_config.json")


def remove_stale(out) -> None:
    """Temp files and folders a run killed mid-write left in `out` and its checkpoints."""
    for folder in (Path(out), Path(out) / "checkpoints"):
        if folder.is_dir():
            remove_stale_temps(folder)


def _rng_state() -> dict:
    np_state = np.random.get_state()
    return {"python": random.getstate(), "numpy": (np_state[0], np_state[1].tolist(), *np_state[2:]),
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(out, step: int, model, trainer_state: dict, data_state: dict, *, keep: int | None = None) -> Path:
    """Write checkpoint `step` (the model, `trainer_state` plus the RNG states, `data_state`) and
    delete all but the newest `keep` (None: delete none)."""
    final = Path(out) / "checkpoints" / f"step-{step:06d}"
    with atomic_dir(final) as tmp:
        model.save_pretrained(tmp / "model")
        torch.save({"step": step, **trainer_state, "rng": _rng_state()}, tmp / "trainer_state.pt")
        (tmp / "data.json").write_text(json.dumps(data_state, indent=2) + "\n")
    _delete_older(out, keep)
    return final


def _delete_older(out, keep: int | None) -> None:
    for old in checkpoints(out)[:-keep] if keep else []:
        shutil.rmtree(old)


def load_checkpoint(ckpt: Path, model) -> tuple[dict, dict]:
    """Load checkpoint `ckpt`'s weights into `model` and restore the RNG states; returns
    (trainer_state, data_state). Refuses a checkpoint of another model shape.

    The weights are copied into the model's own parameters wherever they live, one tensor at a
    time from the memory-mapped file: no second model is built, so an offloaded run's decoder
    layers (in host memory, student/offload/runtime.py) never pass through the device."""
    _check_same_model(ckpt, ckpt / "model" / "config.json", model)
    _check_weights_unchanged(ckpt)
    _copy_weights_into(model, ckpt / "model" / "model.safetensors")
    state = torch.load(ckpt / "trainer_state.pt", map_location="cpu", weights_only=False)
    _set_rng_state(state["rng"])
    return state, json.loads((ckpt / "data.json").read_text())


def _check_same_model(ckpt: Path, config_path: Path, model) -> None:
    """Refuse a checkpoint (its HF config.json at `config_path`) of another model shape than `model`'s."""
    saved = json.loads(config_path.read_text())
    ours = model.config.to_hf_dict(saved.get("dtype", "float32"))
    diffs = [f"{k}: {saved.get(k)!r} (checkpoint) vs {v!r}" for k, v in ours.items() if saved.get(k) != v]
    if diffs:
        raise RunDirError(f"checkpoint {ckpt} is of another model ({'; '.join(diffs[:4])}); use a new `out` "
                          "or remove that checkpoint")


def is_sharded_checkpoint(ckpt: Path) -> bool:
    return (ckpt / "dcp").is_dir()


def save_sharded_checkpoint(out, step: int, model, optimizer, trainer_state: dict, data_state: dict, dist, *,
                            keep: int | None = None) -> Path:
    """A sharded run's checkpoint `step` (module docstring): every rank writes its shards into rank
    0's temp folder, then rank 0 the rest, renames it into place and deletes all but the newest
    `keep` (None: none); every rank returns once it exists. `trainer_state` holds no optimizer."""
    final = Path(out) / "checkpoints" / f"step-{step:06d}"
    with (atomic_dir(final) if dist.main else contextlib.nullcontext()) as tmp:
        shared = [str(tmp) if dist.main else None]
        tdist.broadcast_object_list(shared, src=0)
        tmp = Path(shared[0])
        save_sharded(tmp / "dcp", model, optimizer)
        tdist.barrier()  # every rank's shards are written
        if dist.main:
            dtype = str(model.embed_tokens.weight.dtype).removeprefix("torch.")
            (tmp / "config.json").write_text(json.dumps(model.config.to_hf_dict(dtype), indent=2) + "\n")
            torch.save({"step": step, **trainer_state, "rng": _rng_state(), "world_size": dist.world_size},
                       tmp / "trainer_state.pt")
            (tmp / "data.json").write_text(json.dumps(data_state, indent=2) + "\n")
    if dist.main:
        _delete_older(out, keep)
    tdist.barrier()  # renamed into place before any rank goes on
    return final


def load_sharded_checkpoint(ckpt: Path, model, optimizer) -> tuple[dict, dict]:
    """Load checkpoint `ckpt`, of either kind, into `model` and `optimizer` where one of them is
    sharded (a DCP checkpoint into any model, or a one-process checkpoint into a sharded model),
    keeping the optimizer's hyperparameters; restore the RNG states; returns (trainer_state
    without the optimizer, data_state). Refuses an optimizer whose states' layout follows the world
    size (`world_size_bound`: the 8-bit AdamW's blocks) at another world size than the one that
    wrote them."""
    sharded = is_sharded_checkpoint(ckpt)
    _check_same_model(ckpt, ckpt / ("config.json" if sharded else "model/config.json"), model)
    state = torch.load(ckpt / "trainer_state.pt", map_location="cpu", weights_only=False)
    written_by, world_size = state.get("world_size", 1), tdist.get_world_size() if tdist.is_initialized() else 1
    if getattr(optimizer, "world_size_bound", False) and written_by != world_size:
        raise RunDirError(f"checkpoint {ckpt} was written by {written_by} process(es), this run has {world_size}: "
                          f"the --optimizer {optimizer.name} states are blocked per process's shard; resume with "
                          f"{written_by} process(es) (torchrun --nproc-per-node; 1: without torchrun) or use a new "
                          "`out`")
    if sharded:
        load_sharded(ckpt / "dcp", model, optimizer)
    else:
        _check_weights_unchanged(ckpt)
        weights = Student.from_pretrained(ckpt / "model").state_dict()
        load_full_into_sharded(model, optimizer, weights, state.pop("optimizer"))
    _set_rng_state(state["rng"])
    return state, json.loads((ckpt / "data.json").read_text())


def _check_weights_unchanged(ckpt: Path) -> None:
    """Refuse a checkpoint whose weights file, shared with the final student (a hard link:
    `save_student`), was written to after the checkpoint (whose trainer_state.pt is written after the
    weights): `cp` over the student's file writes into it. Resuming would continue from other weights
    than its optimizer's."""
    weights = ckpt / "model" / "model.safetensors"
    stat = weights.stat()
    if stat.st_nlink > 1 and stat.st_mtime_ns > (ckpt / "trainer_state.pt").stat().st_mtime_ns:
        raise RunDirError(f"checkpoint {ckpt} cannot be resumed: its weights file {weights} is also the final "
                          "student's model.safetensors (a hard link, so the run holds those weights once) and was "
                          "rewritten after the checkpoint (a copy over the student's file writes into both); resume "
                          "from an older checkpoint (--resume-from STEP) or train into a new --out")


def _copy_weights_into(model, file: Path) -> None:
    """Each tensor of `file` (written by Student.save_pretrained) into the parameter of that name."""
    own = model.state_dict()  # the parameters' own storage
    seen = set()
    with safe_open(str(file), framework="pt", device="cpu") as f, torch.no_grad():
        for key in f.keys():
            if key == "lm_head.weight" and model.config.tie_word_embeddings:
                continue  # ours is the embedding
            name = key.removeprefix("model.")
            if name not in own:
                raise RunDirError(f"checkpoint {file.parent.parent} holds {key!r}, which this student has not; use a "
                                  "new `out` or remove that checkpoint")
            own[name].copy_(f.get_tensor(key))
            seen.add(name)
    if missing := sorted(set(own) - seen):
        raise RunDirError(f"checkpoint {file.parent.parent} lacks {missing[:3]}; use a new `out` or remove that "
                          "checkpoint")


def rewind(out, step: int) -> None:
    """Make checkpoint `step` the run's latest: delete the newer checkpoints and the final student
    and evaluation, so the next `train` continues from `step` (its metrics rewound there)."""
    kept = checkpoints(out)
    if step not in [checkpoint_step(c) for c in kept]:
        have = ", ".join(str(checkpoint_step(c)) for c in kept) or "none"
        raise RunDirError(f"--resume-from {step}: {out} has no checkpoint at step {step} (kept: {have})")
    for ckpt in kept:
        if checkpoint_step(ckpt) > step:
            shutil.rmtree(ckpt)
    shutil.rmtree(Path(out) / "student", ignore_errors=True)
    (Path(out) / "eval.json").unlink(missing_ok=True)


def rewind_metrics(path: Path, step: int) -> None:
    """Keep only the rows up to checkpoint `step` (0: none), as a resumed run rewrites what follows."""
    lines = path.read_text().splitlines() if path.exists() and step > 0 else []
    atomic_write_text(path, "".join(line + "\n" for line in lines if _row_step(line) <= step))


def _row_step(line: str) -> float:
    """A row's step; a line cut short by a kill counts as after every checkpoint (dropped)."""
    try:
        return json.loads(line)["step"]
    except json.JSONDecodeError:
        return float("inf")


def save_student(model, folder: Path, tokenizer_dir: str, checkpoint: Path | None = None) -> None:
    """The final student as an HF folder with the tokenizer's files, renamed into place whole.

    checkpoint: a one-process checkpoint that holds exactly `model`'s weights (the run's last one,
    written or loaded at the final step): its model.safetensors becomes the student's too, a hard
    link instead of a second copy; where no link can be made (another file system, or one without
    links) the weights are written, with a warning. None, or a sharded checkpoint: written."""
    weights = None if checkpoint is None else checkpoint / "model" / "model.safetensors"
    with atomic_dir(folder) as tmp:
        if weights is not None and weights.is_file() and _linked(weights, tmp / "model.safetensors"):
            shutil.copy2(weights.parent / "config.json", tmp / "config.json")
        else:
            model.save_pretrained(tmp)  # replaces the (empty) temp folder whole
        for name in TOKENIZER_FILES:
            if (Path(tokenizer_dir) / name).is_file():
                shutil.copy2(Path(tokenizer_dir) / name, tmp / name)


def _linked(source: Path, link: Path) -> bool:
    """Hard-link `source` at `link`; False (and a warning) where the file system refuses."""
    try:
        os.link(source, link)
        return True
    except OSError as error:
        logger.warning("could not hard-link %s into the student folder (%s): writing a second copy of the weights",
                       source, error)
        return False
