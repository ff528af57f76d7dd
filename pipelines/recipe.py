"""Recipes: one TOML file that links the stages (teacher -> cache -> student -> evaluation).

A recipe has the sections [teacher], [corpus], [cache], [student] and [train]. Their keys are the
fields of ``TeacherConfig``, ``CorpusConfig`` and ``CacheConfig``, and in [train] the flat names of
``TrainConfig`` (``TrainConfig.to_flat()``: the same names as train-student's options, e.g.
``warmup_steps`` for ``--warmup-steps``); a key left out takes the same default as the CLI's.
[student] says where the student starts: ``from = "teacher"`` with ``num_layers`` (layers pruned
from the teacher, evenly spaced) or ``from = "path/to/hf-folder"``. Relative paths are relative to
the directory the command runs in, like the CLI's. Example: ``pipelines/recipes/quickstart.toml``.

Several caches (a data mixture): [[cache]] entries instead of one [cache] table, each a [cache]
with its own ``out`` and, as inline tables, the [corpus] and [teacher] keys it changes
(``corpus = {paths = ["docs"], file_glob = "*.md"}``); the student trains on them all, in the shares
of [train] cache_weights (``[0.7, 0.3]``; equal when left out), which a [sweep] may vary
(``"train.cache_weights" = [[1, 0], [0.5, 0.5]]``). Example: ``pipelines/recipes/mixture.toml``.

A [rounds] section adds on-policy rounds after the run (pipelines/rounds.py: generate with the
student, score with the teacher, train on the round's cache mixed with the earlier ones), each
stage resumable; its keys are ``RoundsConfig``'s. Example: ``pipelines/recipes/rounds.toml``.

A [sweep] section lists values of [train] or [student] keys, as ``"section.key" = [values]`` (or
TOML's dotted ``train.lr = [...]``): the recipe becomes the grid of every combination, in the order
written, each point a run directory under [train] out named after its settings
(``lr=0.001,optimizer=foam``). Every point trains on the recipe's caches, so cache, corpus and
teacher keys cannot be swept (cache weights, a [train] key, can). A sweep resumes: a point whose run holds its final student is
skipped, an interrupted one continues through the trainer's own resume.

``load_recipe`` checks the whole recipe (every sweep point included) before any work (every section, key, type and range, and
that the training temperature composes with the cache's): one line naming ``[section] key``.
``run_recipe`` builds the cache (or reuses a complete one of the same identity without loading
the teacher), trains the student (or resumes an interrupted run), and returns the evaluation of
the student before and after training next to the teacher's own numbers.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import tomllib
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from distill.configs import ConfigError, check_types, from_dict, require
from distill.errors import DistillUserError
from teacher_cache.build import CacheConfig

from pipelines.corpus import CorpusConfig
from pipelines.rounds import RoundsConfig
from pipelines.stage_one import StageOneConfig, TeacherConfig

SECTIONS = ("teacher", "corpus", "cache", "student", "train")
SWEEPABLE = ("train", "student")  # the caches are shared: their sections cannot vary within a sweep
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
    caches: list[StageOneConfig]  # one per cache ([cache], or each [[cache]] entry), in order
    student: StudentInit
    train: dict[str, Any] = field(default_factory=dict)  # TrainConfig flat fields other than cache and init
    source: Path | None = None
    settings: dict[str, Any] = field(default_factory=dict)  # a sweep point's values, {"train.lr": 0.001}
    points: list[Recipe] = field(default_factory=list)  # a sweep's points, in order ([] without [sweep])
    rounds: RoundsConfig | None = None  # on-policy rounds after the run ([rounds]); None: none

    @property
    def stage_one(self) -> StageOneConfig:
        """The first cache's stage one (a one-cache recipe's only)."""
        return self.caches[0]


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
        sweep = _sweep_keys(doc.pop("sweep", {}))
        recipe = _build(path, copy.deepcopy(doc))
        if sweep:  # without one there are no points (the grid of no keys would be one empty point)
            recipe.points = [_point(path, doc, settings, Path(recipe.train["out"])) for settings in _grid(sweep)]
    except DistillUserError as e:
        raise DistillUserError(f"recipe {path}: {e}") from None
    if recipe.points and recipe.rounds is not None:
        raise DistillUserError(f"recipe {path}: [rounds] and [sweep] cannot go together; give the rounds a recipe "
                               "of their own")
    names = [point.name for point in recipe.points]
    if len(set(names)) < len(names):
        raise DistillUserError(f"recipe {path}: [sweep] gives two points the same run name ({names}); "
                               "list each value once")
    return recipe


def _sweep_keys(sweep) -> dict[str, list]:
    """{"train.lr": [values], ...} from [sweep] (quoted "train.lr" keys or TOML dotted keys)."""
    if not isinstance(sweep, dict):
        raise DistillUserError(f"[sweep] must be a table of keys, got {type(sweep).__name__}")
    flat = {}
    for key, value in sweep.items():
        if isinstance(value, dict):  # train.lr = [...] parses as {"train": {"lr": [...]}}
            flat.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            flat[key] = value
    for key, values in flat.items():
        section, _, name = key.partition(".")
        if section not in SWEEPABLE or not name or "." in name:
            raise DistillUserError(f"[sweep] key {key!r} must be SECTION.KEY with SECTION one of "
                                   f"{', '.join(SWEEPABLE)} (every point shares the one cache, or [[cache]] list; a recipe per cache "
                                   "sweeps teacher, corpus or cache settings)")
        if key == "train.out":
            raise DistillUserError("[sweep] cannot vary train.out: each point's run directory is named under it")
        if not isinstance(values, list) or not values:
            raise DistillUserError(f"[sweep] {key} must be a non-empty list of values, got {values!r}")
    return flat


def _grid(sweep: dict[str, list]) -> list[dict[str, Any]]:
    """Every combination of the sweep's values, the first key varying slowest."""
    return [dict(zip(sweep, values)) for values in itertools.product(*sweep.values())]


def point_name(settings: dict[str, Any]) -> str:
    """A run directory name from a point's settings: ``lr=0.001,optimizer=foam`` (the key without its
    section unless two keys share it; a path value by its last part)."""
    shorts = [key.partition(".")[2] for key in settings]
    parts = []
    for (key, value), short in zip(settings.items(), shorts):
        label = short if shorts.count(short) == 1 else key
        if isinstance(value, bool):
            text = str(value).lower()
        elif isinstance(value, list):  # cache weights: 0.7+0.3
            text = "+".join(map(str, value))
        elif isinstance(value, str):
            text = Path(value).name or value
        else:
            text = repr(value)
        parts.append(f"{label}={text}")
    return ",".join(parts)


def _point(path: Path, doc: dict, settings: dict[str, Any], sweep_dir: Path) -> Recipe:
    """One sweep point, checked whole like a recipe; an error names the point."""
    name = point_name(settings)
    point_doc = copy.deepcopy(doc)
    for key, value in settings.items():
        section, _, field_name = key.partition(".")
        point_doc.setdefault(section, {})[field_name] = value
    point_doc["train"]["out"] = str(sweep_dir / name)
    point_doc["name"] = name
    try:
        point = _build(path, point_doc)
    except DistillUserError as e:
        raise DistillUserError(f"[sweep] point {name}: {e}") from None
    point.settings = settings
    return point


def _build(path: Path, doc: dict) -> Recipe:
    name = doc.pop("name", path.stem)
    if not isinstance(name, str):
        raise DistillUserError(f"name must be a string, got {name!r}")
    rounds_body = doc.pop("rounds", None)
    unknown = sorted(set(doc) - set(SECTIONS))
    if unknown:
        allowed = ", ".join(f"[{s}]" for s in (*SECTIONS, "rounds", "sweep"))  # load_recipe took [sweep] out before
        raise DistillUserError(f"unknown section(s) {unknown}; allowed: {allowed} (and a top-level name)")
    sections = {s: doc.get(s, {}) for s in SECTIONS}
    for s, body in sections.items():
        if not isinstance(body, dict) and not (s == "cache" and isinstance(body, list)):
            raise DistillUserError(f"[{s}] must be a table of keys, got {type(body).__name__}")
    entries = sections["cache"] if isinstance(sections["cache"], list) else [sections["cache"]]
    if not entries:
        raise DistillUserError('[[cache]] needs at least one entry with out = "DIR"')
    caches = [_stage_one(sections["teacher"], sections["corpus"], entry,
                         "cache" if len(entries) == 1 else f"cache {place + 1}") for place, entry in enumerate(entries)]
    outs = [str(c.cache.out) for c in caches]
    if len(set(outs)) < len(outs):
        raise DistillUserError(f"[[cache]] entries share an out ({outs}); give each cache a folder of its own")
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
    rounds = None
    if rounds_body is not None:
        if not isinstance(rounds_body, dict):
            raise DistillUserError(f"[rounds] must be a table of keys, got {type(rounds_body).__name__}")
        rounds = _section(RoundsConfig, rounds_body, "rounds")
    recipe = Recipe(name=name, caches=caches, student=student, train=train, source=path, rounds=rounds)
    config = train_config(recipe, teacher_dir=Path("TEACHER"))  # the real folder is found (or imported) later
    if rounds is not None and rounds.max_prompts * rounds.samples_per_prompt <= config.heldout:
        raise DistillUserError(f"[rounds] max_prompts x samples_per_prompt ({rounds.max_prompts * rounds.samples_per_prompt}"
                               f") must exceed [train] heldout ({config.heldout}): each round's cache keeps that many "
                               "sequences for evaluation and trains on the rest")
    try:
        for stage_one in caches:
            config.loss.check_cache_temperature(stage_one.cache.temperature, kind=stage_one.cache.targets)
    except ConfigError as e:
        raise e.in_section("train") from None
    return recipe


def _stage_one(teacher: dict, corpus: dict, entry, section: str) -> StageOneConfig:
    """One cache's stage one: the recipe's [teacher] and [corpus] with the keys its cache entry
    changes (inline tables `teacher` and `corpus`), and the entry's own [cache] keys."""
    if not isinstance(entry, dict):
        raise DistillUserError(f"[{section}] must be a table of keys, got {type(entry).__name__}")
    cache = dict(entry)
    changes = {key: cache.pop(key, {}) for key in ("teacher", "corpus")}
    for key, value in changes.items():
        if not isinstance(value, dict):
            raise DistillUserError(f"[{section}] {key} must be an inline table of [{key}] keys, got {value!r}")
    teacher, corpus = {**teacher, **changes["teacher"]}, {**corpus, **changes["corpus"]}
    if teacher.get("model") in ("", "default"):
        del teacher["model"]
    for key in ("paths", "exclude_dirs"):  # TOML arrays; the config holds tuples
        if isinstance(corpus.get(key), list):
            corpus[key] = tuple(corpus[key])
    if "out" not in cache:
        raise DistillUserError(f'[{section}] needs out = "DIR" (where the cache is written or reused)')
    where = lambda part: part if section == "cache" else f"{section} {part}"  # "[cache 2 corpus] paths"
    return StageOneConfig(teacher=_section(TeacherConfig, teacher, where("teacher")),
                          corpus=_section(CorpusConfig, corpus, where("corpus")),
                          cache=_section(CacheConfig, cache, section))


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
    """The ``TrainConfig`` of a recipe whose caches are at their [cache] out; errors name [train] keys."""
    from student.train_config import TrainConfig

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
        return TrainConfig.from_flat(cache=[str(c.cache.out) for c in recipe.caches], **init, **recipe.train)
    except ConfigError as e:
        raise e.in_section("train") from None


@dataclass
class PointResult:
    name: str
    run_dir: Path
    state: str  # "skipped" (its final student existed) | "trained" | "resumed" (from a checkpoint)
    seconds: float


@dataclass
class RecipeReport:
    cache_dirs: list[Path]  # in the recipe's order
    cache_reused: bool  # every cache was complete and matching already
    run_dir: Path  # the run, or for a sweep the folder of its points' runs
    evaluation: dict  # {"teacher": EvalResult, "before": EvalResult | None, "after": EvalResult}; {} for a sweep
    wall_seconds: dict  # {"cache": s, "train": s} (and "rounds": s)
    points: list[PointResult] = field(default_factory=list)  # a sweep's points, in order
    rounds: list = field(default_factory=list)  # [rounds]: each round's pipelines.rounds.RoundPaths


def run_state(run_dir: str | Path) -> str:
    """"finished" (its final student exists), "started" (a run.json: training resumes it) or "new"."""
    run_dir = Path(run_dir)
    if (run_dir / "student").is_dir():
        return "finished"
    return "started" if (run_dir / "run.json").is_file() else "new"


def run_points(recipe: Recipe, teacher_dir: str | Path, progress: bool = True) -> list[PointResult]:
    """Train a sweep's points one after another on the recipe's cache (built already): a finished
    point is skipped, an interrupted one resumes from its last checkpoint."""
    import time

    from student.trainer import train

    results = []
    for point in recipe.points:
        config = train_config(point, teacher_dir)
        if run_state(config.out) == "finished":
            results.append(PointResult(point.name, Path(config.out), "skipped", 0.0))
            continue
        start = time.perf_counter()
        try:
            report = train(config, progress=progress)
        except ConfigError as e:
            raise e.in_section("train") from None
        state = "resumed" if report.resumed_from else "trained"
        results.append(PointResult(point.name, Path(config.out), state, time.perf_counter() - start))
    return results


def _stage_one_error(error: ConfigError) -> DistillUserError:
    """A stage-one ConfigError named as the recipe key that sets its field (`out` -> [cache] out)."""
    for section, part in (("teacher", TeacherConfig), ("corpus", CorpusConfig), ("cache", CacheConfig)):
        if error.field in {f.name for f in fields(part)}:
            return error.in_section(section)
    return error


def run_recipe(recipe: Recipe, progress: bool = True, on_stage=None) -> RecipeReport:
    """Stage one (reusing a complete matching cache), then training (resuming), then evaluation,
    then the [rounds] (pipelines/rounds.run_rounds, given `on_stage`); for a sweep, stage one once
    and then every point (run_points)."""
    import time

    from pipelines.defaults import default_teacher_dir
    from pipelines.stage_one import cache_teacher
    from student.evaluate import evaluate_run_or_folder
    from student.trainer import train

    teacher_dir = recipe.stage_one.teacher.model or default_teacher_dir()
    config = train_config(recipe, teacher_dir)  # load_recipe has checked it, before the teacher runs
    start = time.perf_counter()
    built = []
    for place, stage_one in enumerate(recipe.caches):
        try:
            built.append(cache_teacher(stage_one, progress=progress))
        except ConfigError as e:  # e.g. [cache] out holds another cache
            error = _stage_one_error(e)
            raise (error if len(recipe.caches) == 1 else DistillUserError(f"[[cache]] {place + 1}: {error}")) from None
    cache_dirs, cache_reused = [Path(b.cache_dir) for b in built], all(b.already_complete for b in built)
    cache_seconds = time.perf_counter() - start
    start = time.perf_counter()
    if recipe.points:
        points = run_points(recipe, teacher_dir, progress=progress)
        return RecipeReport(cache_dirs=cache_dirs, cache_reused=cache_reused,
                            run_dir=Path(recipe.train["out"]), evaluation={}, points=points,
                            wall_seconds={"cache": cache_seconds, "train": time.perf_counter() - start})
    try:
        train(config, progress=progress)
    except ConfigError as e:  # e.g. fewer steps than the run's last checkpoint
        raise e.in_section("train") from None
    train_seconds = time.perf_counter() - start
    evaluation = evaluate_run_or_folder(config.out)
    report = RecipeReport(
        cache_dirs=cache_dirs, cache_reused=cache_reused, run_dir=Path(config.out),
        evaluation=evaluation, wall_seconds={"cache": cache_seconds, "train": train_seconds},
    )
    if recipe.rounds is not None:
        from pipelines.rounds import run_rounds

        start = time.perf_counter()
        report.rounds = run_rounds(recipe.rounds, config, recipe.caches, progress=progress, on_stage=on_stage)
        report.wall_seconds["rounds"] = time.perf_counter() - start
    return report
