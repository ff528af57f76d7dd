"""What a run directory keeps on disk (student/checkpoint.py): a checkpoint holds what a resume needs,
each tensor once; the final student shares the last checkpoint's weights file instead of a second
copy; --keep-checkpoints says how many are kept; a weights file rewritten through the student folder
is refused on resume instead of resuming from other weights than its optimizer's."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from distill.configs import ConfigError
from student.model import Student
from student.trainer import RunDirError, train
from test_trainer import config, make_student, rows, tiny  # noqa: F401  (the module-scoped fixture)

# torch.save's pickle of the state's structure (param groups, the RNG states' Python and NumPy
# lists) beside the tensors' bytes: a few KB for this student; a duplicated tensor would add its size.
PICKLE_SLACK = 64 << 10


def _tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def _kept(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").iterdir())


@pytest.mark.parametrize("optimizer", ["adamw", "adamw8bit"])
def test_a_checkpoint_holds_each_tensor_once_and_the_student_shares_its_weights(tiny, tmp_path, optimizer):
    """A tied student (the lm-head is the embedding, as SmolLM2's): the weights file holds every
    parameter once in fp32, trainer_state.pt the optimizer's state as it holds it plus a few KB, and
    the final student's weights are the last checkpoint's file, not a copy."""
    student = make_student(tmp_path / "tied", tie_word_embeddings=True)
    out = tmp_path / "run"
    train(config(tiny, out, student=str(student), steps=4, save_every=2, eval_every=0, optimizer=optimizer),
          progress=False)
    ckpt = out / "checkpoints" / "step-000004"
    assert sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file()) == [
        "data.json", "model/config.json", "model/model.safetensors", "trainer_state.pt"]

    model = Student.from_pretrained(student)
    with safe_open(str(ckpt / "model" / "model.safetensors"), framework="pt") as f:
        saved = {key: f.get_slice(key).get_shape() for key in f.keys()}
        assert {f.get_slice(key).get_dtype() for key in f.keys()} == {"F32"}
    assert "lm_head.weight" not in saved
    assert sum(torch.Size(s).numel() for s in saved.values()) == sum(p.numel() for p in model.parameters())

    state = torch.load(ckpt / "trainer_state.pt", weights_only=False)
    assert set(state) == {"step", "loss", "optimizer", "rng"} and state["step"] == 4
    optimizer_bytes = sum(t.numel() * t.element_size() for t in _tensors(state["optimizer"]))
    assert optimizer_bytes == rows(out)[-1]["optimizer_state_bytes"]  # what the optimizer holds, no more
    all_bytes = sum(t.numel() * t.element_size() for t in _tensors(state))
    assert all_bytes <= (ckpt / "trainer_state.pt").stat().st_size <= all_bytes + PICKLE_SLACK

    weights = out / "student" / "model.safetensors"
    assert os.path.samefile(weights, ckpt / "model" / "model.safetensors")
    assert (out / "student" / "config.json").read_text() == (ckpt / "model" / "config.json").read_text()
    assert (out / "student" / "tokenizer.json").is_file()
    assert set(Student.from_pretrained(out / "student").state_dict()) == set(model.state_dict())


def test_keep_checkpoints_keeps_the_newest_and_may_change_on_a_rerun(tiny, tmp_path):
    out = tmp_path / "run"
    train(config(tiny, out, steps=6, save_every=2, eval_every=0, keep_checkpoints=3), progress=False)
    assert _kept(out) == ["step-000002", "step-000004", "step-000006"]
    first_student = out / "student" / "model.safetensors"
    old_weights = (out / "checkpoints" / "step-000006" / "model" / "model.safetensors").read_bytes()

    report = train(config(tiny, out, steps=8, save_every=2, eval_every=0, keep_checkpoints=1), progress=False)
    assert report.resumed_from == 6 and _kept(out) == ["step-000008"]
    assert rows(out, "change") == [{"kind": "change", "step": 6, "changes": {"steps": [6, 8]}}]  # not recorded
    assert json.loads((out / "run.json").read_text())["config"]["keep_checkpoints"] == 1
    assert os.path.samefile(first_student, out / "checkpoints" / "step-000008" / "model" / "model.safetensors")
    assert first_student.read_bytes() != old_weights  # the extended run's student

    with pytest.raises(ConfigError, match="`keep_checkpoints` must be .*, got 0"):
        config(tiny, out, keep_checkpoints=0)


def test_weights_rewritten_through_the_student_folder_are_refused_on_resume(tiny, tmp_path):
    """Copying other weights over RUN/student/model.safetensors (cp, shutil.copyfile: they write into
    the existing file) changes the last checkpoint's weights with it: extending the run from that
    checkpoint is refused; an older checkpoint still resumes."""
    out = tmp_path / "run"
    train(config(tiny, out, steps=4, save_every=2, eval_every=0), progress=False)
    weights = out / "student" / "model.safetensors"
    with safe_open(str(weights), framework="pt") as f:
        changed = {key: f.get_tensor(key) * 0.5 for key in f.keys()}
    save_file(changed, str(tmp_path / "finetuned.safetensors"), metadata={"format": "pt"})
    shutil.copyfile(tmp_path / "finetuned.safetensors", weights)
    assert os.path.samefile(weights, out / "checkpoints" / "step-000004" / "model" / "model.safetensors")

    with pytest.raises(RunDirError, match=r"step-000004 cannot be resumed: .* rewritten after the checkpoint"):
        train(config(tiny, out, steps=6, save_every=2, eval_every=0), progress=False)
    report = train(config(tiny, out, steps=6, save_every=2, eval_every=0), progress=False, resume_from=2)
    assert report.resumed_from == 2 and report.steps == 6


def test_where_no_link_can_be_made_the_student_is_written_with_a_warning(tiny, tmp_path, monkeypatch, caplog):
    def refuse(src, dst):
        raise OSError(1, "Operation not permitted")

    monkeypatch.setattr(os, "link", refuse)
    out = tmp_path / "run"
    with caplog.at_level("WARNING", logger="student.checkpoint"):
        train(config(tiny, out, steps=2, save_every=2, eval_every=0), progress=False)
    assert any("could not hard-link" in m and "second copy" in m for m in caplog.messages)
    weights, ckpt_weights = out / "student" / "model.safetensors", out / "checkpoints" / "step-000002" / "model"
    assert not os.path.samefile(weights, ckpt_weights / "model.safetensors")
    assert weights.read_bytes() == (ckpt_weights / "model.safetensors").read_bytes()
