"""Recipes: one TOML file that links the stages (teacher -> cache -> student -> evaluation).

A recipe has the sections [teacher], [corpus], [cache], [student] and [train]. Their keys are the
fields of ``TeacherConfig``, ``CorpusConfig``, ``CacheConfig`` and ``TrainConfig``; [student] says
where the student starts: ``from = "teacher"`` with ``num_layers`` (layers pruned from the teacher,
evenly spaced) or ``from = "path/to/hf-folder"``. Relative paths are relative to the directory
the command runs in, like the CLI's. Example: ``pipelines/recipes/quickstart.toml``.

``run_recipe`` builds the cache (or reuses a complete one of the same identity without loading
the teacher), trains the student (or resumes an interrupted run), and returns the evaluation of
the student before and after training next to the teacher's own numbers.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from teacher_cache.build import CacheConfig
from distill.errors import DistillUserError

from pipelines.corpus import CorpusConfig
from pipelines.stage_one import StageOneConfig, TeacherConfig

SECTIONS = ("teacher", "corpus", "cache", "student", "train")
RECIPES_DIR = Path(__file__).parent / "recipes"


@dataclass
class StudentInit:
    """Where the student starts: pruned from the teacher, or an HF folder."""

    source: str = "teacher"  # "teacher" | path of an HF folder
    num_layers: int | None = 4  # with source = "teacher": layers kept (evenly spaced)


@dataclass
class Recipe:
    name: str
    stage_one: StageOneConfig
    student: StudentInit
    train: dict[str, Any] = field(default_factory=dict)  # TrainConfig fields other than cache and init
    source: Path | None = None


def builtin_recipe(name: str) -> Path:
    """Path of a recipe shipped in pipelines/recipes/ (e.g. "quickstart")."""
    path = RECIPES_DIR / f"{name}.toml"
    if not path.is_file():
        shipped = ", ".join(sorted(p.stem for p in RECIPES_DIR.glob("*.toml")))
        raise DistillUserError(f"no built-in recipe {name!r}; shipped: {shipped}")
    return path


def load_recipe(path: str | Path) -> Recipe:
    """Parse and check a recipe file; every unknown section or key is an error that names it."""
    path = Path(path)
    if not path.is_file():
        raise DistillUserError(f"recipe {path} does not exist; give a TOML file (see pipelines/recipes/quickstart.toml)")
    try:
        doc = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise DistillUserError(f"recipe {path} is not valid TOML: {e}") from None
    name = doc.pop("name", path.stem)
    unknown = sorted(set(doc) - set(SECTIONS))
    if unknown:
        raise DistillUserError(f"recipe {path}: unknown section(s) {unknown}; allowed: {', '.join(SECTIONS)}")
    sections = {s: doc.get(s, {}) for s in SECTIONS}
    for s, body in sections.items():
        if not isinstance(body, dict):
            raise DistillUserError(f"recipe {path}: [{s}] must be a table of keys, got {type(body).__name__}")

    def build(cls, section: str, **fixed):
        body = dict(sections[section])
        if section == "student" and "from" in body:
            body["source"] = body.pop("from")
        allowed = {f.name for f in dataclasses.fields(cls)} - set(fixed)
        bad = sorted(set(body) - allowed)
        if bad:
            raise DistillUserError(f"recipe {path}: unknown key(s) {bad} in [{section}]; allowed: {', '.join(sorted(allowed))}")
        try:
            return cls(**body, **fixed)
        except TypeError as e:
            raise DistillUserError(f"recipe {path}: [{section}]: {e}") from None

    cache_body = dict(sections["cache"])
    if "out" not in cache_body:
        raise DistillUserError(f"recipe {path}: [cache] needs out = \"DIR\" (where the cache is written or reused)")
    sections["cache"] = {**cache_body, "out": Path(cache_body["out"])}
    if "paths" in sections["corpus"]:
        sections["corpus"] = {**sections["corpus"], "paths": tuple(sections["corpus"]["paths"])}
    if "model" in sections["teacher"] and sections["teacher"]["model"] in ("", "default"):
        sections["teacher"] = {k: v for k, v in sections["teacher"].items() if k != "model"}
    stage_one = StageOneConfig(
        teacher=build(TeacherConfig, "teacher"),
        corpus=build(CorpusConfig, "corpus"),
        cache=build(CacheConfig, "cache"),
    )
    student = build(StudentInit, "student")
    if "out" not in sections["train"]:
        raise DistillUserError(f"recipe {path}: [train] needs out = \"DIR\" (the run directory)")
    train = _check_train_keys(path, dict(sections["train"]))
    return Recipe(name=str(name), stage_one=stage_one, student=student, train=train, source=path)


def _check_train_keys(path: Path, body: dict) -> dict:
    from student.trainer import TrainConfig

    reserved = {"cache", "student", "teacher", "num_layers"}  # set from [cache] and [student]
    allowed = {f.name for f in dataclasses.fields(TrainConfig)} - reserved
    bad = sorted(set(body) - allowed)
    if bad:
        raise DistillUserError(f"recipe {path}: unknown key(s) {bad} in [train]; allowed: {', '.join(sorted(allowed))}")
    return body


def train_config(recipe: Recipe, teacher_dir: Path):
    """The ``TrainConfig`` of a recipe whose cache is at ``recipe.stage_one.cache.out``."""
    from student.trainer import TrainConfig

    init: dict[str, Any]
    if recipe.student.source == "teacher":
        init = {"teacher": str(teacher_dir), "num_layers": recipe.student.num_layers}
    else:
        init = {"student": str(recipe.student.source)}
    return TrainConfig(cache=str(recipe.stage_one.cache.out), **init, **recipe.train)


@dataclass
class RecipeReport:
    cache_dir: Path
    cache_reused: bool
    run_dir: Path
    evaluation: dict  # {"teacher": EvalResult, "before": EvalResult | None, "after": EvalResult}
    wall_seconds: dict  # {"cache": s, "train": s}


def run_recipe(recipe: Recipe, progress: bool = True) -> RecipeReport:
    """Stage one (reusing a complete matching cache), then training (resuming), then evaluation."""
    import time

    from pipelines.defaults import default_teacher_dir
    from pipelines.stage_one import cache_teacher
    from student.evaluate import evaluate_run_or_folder
    from student.trainer import train

    teacher_dir = recipe.stage_one.teacher.model or default_teacher_dir()
    config = train_config(recipe, teacher_dir)  # checked before the teacher runs
    start = time.perf_counter()
    built = cache_teacher(recipe.stage_one, progress=progress)
    cache_seconds = time.perf_counter() - start
    start = time.perf_counter()
    train(config, progress=progress)
    train_seconds = time.perf_counter() - start
    evaluation = evaluate_run_or_folder(config.out)
    return RecipeReport(
        cache_dir=built.cache_dir, cache_reused=built.already_complete, run_dir=Path(config.out),
        evaluation=evaluation, wall_seconds={"cache": cache_seconds, "train": train_seconds},
    )
