"""Recipes: one TOML file that links the stages (teacher -> cache -> student -> evaluation).

A recipe has the sections [teacher], [corpus], [cache], [student] and [train]. Their keys are the
fields of ``TeacherConfig``, ``CorpusConfig`` and ``CacheConfig``, and in [train] the flat names of
``TrainConfig`` (``TrainConfig.to_flat()``: the same names as train-student's options, e.g.
``warmup_steps`` for ``--warmup-steps``); a key left out takes the same default as the CLI's.
[student] says where the student starts: ``from = "teacher"`` with ``num_layers`` (layers pruned
from the teacher, evenly spaced) or ``from = "path/to/hf-folder"``. Relative paths are relative to
the directory the command runs in, like the CLI's. Example: ``pipelines/recipes/quickstart.toml``.

``load_recipe`` checks the whole recipe before any work (every section, key, type and range, and
that the training temperature composes with the cache's): one line naming ``[section] key``.
``run_recipe`` builds the cache (or reuses a complete one of the same identity without loading
the teacher), trains the student (or resumes an interrupted run), and returns the evaluation of
the student before and after training next to the teacher's own numbers.
"""

from __future__ import annotations

import dataclasses
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distill.configs import ConfigError, check_types, from_dict, require
from distill.errors import DistillUserError
from teacher_cache.build import CacheConfig

from pipelines.corpus import CorpusConfig
from pipelines.stage_one import StageOneConfig, TeacherConfig

SECTIONS = ("teacher", "corpus", "cache", "student", "train")
RECIPES_DIR = Path(__file__).parent / "recipes"
# [train] keys set by the other sections: the cache by [cache] out, the initial student by [student].
_TRAIN_FROM_OTHER_SECTIONS = {"cache": "[cache] out", "student": "[student] from", "teacher": "[teacher] model",
                              "num_layers": "[student] num_layers"}


@dataclass
class StudentInit:
    """Where the student starts: pruned from the teacher, or an HF folder."""

    source: str = "teacher"  # the recipe's `from`: "teacher" | path of an HF folder
    num_layers: int | None = 4  # with source = "teacher": layers kept (evenly spaced)

    def __post_init__(self):
        check_types(self)
        require("num_layers", self.num_layers, self.num_layers is None or self.num_layers >= 1,
                "an integer >= 1 (layers kept from the teacher)")
        if self.source == "teacher" and self.num_layers is None:
            raise ConfigError("num_layers", 'is needed with from = "teacher" (how many layers the student keeps)')


@dataclass
class Recipe:
    name: str
    stage_one: StageOneConfig
    student: StudentInit
    train: dict[str, Any] = field(default_factory=dict)  # TrainConfig flat fields other than cache and init
    source: Path | None = None


def builtin_recipe(name: str) -> Path:
    """Path of a recipe shipped in pipelines/recipes/ (e.g. "quickstart")."""
    path = RECIPES_DIR / f"{name}.toml"
    if not path.is_file():
        shipped = ", ".join(sorted(p.stem for p in RECIPES_DIR.glob("*.toml")))
        raise DistillUserError(f"no built-in recipe {name!r}; shipped: {shipped}")
    return path


def load_recipe(path: str | Path) -> Recipe:
    """Parse and check the whole recipe; any mistake is one error naming the recipe, [section] and key."""
    path = Path(path)
    if not path.is_file():
        raise DistillUserError(f"recipe {path} does not exist; give a TOML file (see pipelines/recipes/quickstart.toml)")
    try:
        doc = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise DistillUserError(f"recipe {path} is not valid TOML: {e}") from None
    try:
        return _build(path, doc)
    except DistillUserError as e:
        raise DistillUserError(f"recipe {path}: {e}") from None


def _build(path: Path, doc: dict) -> Recipe:
    name = doc.pop("name", path.stem)
    if not isinstance(name, str):
        raise DistillUserError(f"name must be a string, got {name!r}")
    unknown = sorted(set(doc) - set(SECTIONS))
    if unknown:
        raise DistillUserError(f"unknown section(s) {unknown}; allowed: {', '.join(SECTIONS)}")
    sections = {s: doc.get(s, {}) for s in SECTIONS}
    for s, body in sections.items():
        if not isinstance(body, dict):
            raise DistillUserError(f"[{s}] must be a table of keys, got {type(body).__name__}")
    teacher, corpus, cache = dict(sections["teacher"]), dict(sections["corpus"]), dict(sections["cache"])
    if teacher.get("model") in ("", "default"):
        del teacher["model"]
    for key in ("paths", "exclude_dirs"):  # TOML arrays; the config holds tuples
        if isinstance(corpus.get(key), list):
            corpus[key] = tuple(corpus[key])
    if "out" not in cache:
        raise DistillUserError('[cache] needs out = "DIR" (where the cache is written or reused)')
    stage_one = StageOneConfig(teacher=_section(TeacherConfig, teacher, "teacher"),
                               corpus=_section(CorpusConfig, corpus, "corpus"),
                               cache=_section(CacheConfig, cache, "cache"))
    student_body = dict(sections["student"])
    if "from" in student_body:
        student_body["source"] = student_body.pop("from")
    try:
        student = _section(StudentInit, student_body, "student")
    except DistillUserError as e:  # the field `source` is the recipe's key `from`
        raise DistillUserError(str(e).replace("[student] source", "[student] from")) from None
    train = dict(sections["train"])
    if "out" not in train:
        raise DistillUserError('[train] needs out = "DIR" (the run directory)')
    for key, where in _TRAIN_FROM_OTHER_SECTIONS.items():
        if key in train:
            raise DistillUserError(f"[train] {key} is not a [train] key: {where} sets it")
    recipe = Recipe(name=name, stage_one=stage_one, student=student, train=train, source=path)
    config = train_config(recipe, teacher_dir=Path("TEACHER"))  # the real folder is found (or imported) later
    try:
        config.loss.check_cache_temperature(stage_one.cache.temperature)
    except ConfigError as e:
        raise e.in_section("train") from None
    return recipe


def _section(cls, body: dict, section: str):
    """`cls` from a recipe section: unknown keys and wrong types are refused naming [section] key
    before the config's own checks run (some of which would stumble on a wrong type)."""
    hints = typing.get_type_hints(cls)
    known = {k: v for k, v in body.items() if k in hints}
    probe = dataclasses.make_dataclass(f"{cls.__name__}Types", [(k, hints[k]) for k in known])
    try:
        check_types(probe(**known))
        return from_dict(cls, body, section)
    except ConfigError as e:
        raise e.in_section(section) from None
    except DistillUserError as e:
        if str(e).startswith(f"[{section}]"):
            raise
        raise DistillUserError(f"[{section}] {e}") from None


def train_config(recipe: Recipe, teacher_dir: Path):
    """The ``TrainConfig`` of a recipe whose cache is at ``recipe.stage_one.cache.out``; errors name [train] keys."""
    from student.trainer import TrainConfig

    init: dict[str, Any]
    if recipe.student.source == "teacher":
        init = {"teacher": str(teacher_dir), "num_layers": recipe.student.num_layers}
    else:
        init = {"student": str(recipe.student.source)}
    known = set(TrainConfig.flat_defaults()) | {"out"}
    unknown = sorted(set(recipe.train) - known - set(_TRAIN_FROM_OTHER_SECTIONS))
    if unknown:
        raise DistillUserError(f"[train] unknown key(s) {', '.join(unknown)}; known: "
                               f"{', '.join(sorted(known - set(_TRAIN_FROM_OTHER_SECTIONS)))}")
    try:
        return TrainConfig.from_flat(cache=str(recipe.stage_one.cache.out), **init, **recipe.train)
    except ConfigError as e:
        raise e.in_section("train") from None


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
    config = train_config(recipe, teacher_dir)  # load_recipe has checked it, before the teacher runs
    start = time.perf_counter()
    built = cache_teacher(recipe.stage_one, progress=progress)
    cache_seconds = time.perf_counter() - start
    start = time.perf_counter()
    try:
        train(config, progress=progress)
    except ConfigError as e:  # e.g. fewer steps than the run's last checkpoint
        raise e.in_section("train") from None
    train_seconds = time.perf_counter() - start
    evaluation = evaluate_run_or_folder(config.out)
    return RecipeReport(
        cache_dir=built.cache_dir, cache_reused=built.already_complete, run_dir=Path(config.out),
        evaluation=evaluation, wall_seconds={"cache": cache_seconds, "train": train_seconds},
    )
