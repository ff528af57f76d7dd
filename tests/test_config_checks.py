"""The checks of the configs behind train-student: every float a user sets is refused when it is
not finite (inf passes `> 0`, nan fails every comparison), and an optional field's error says to
leave it out, since neither an option nor a recipe key can be given None."""

from __future__ import annotations

import math

import pytest

from distill.configs import ConfigError
from student.long_context.config import LongContextConfig
from student.loss_config import LossConfig
from student.optim.config import OptimizerConfig
from student.schedule import ScheduleConfig
from student.sparse_ffn_config import SparseFFNConfig

# (config, field, extra settings the field needs to be read): every float field a user sets
FLOAT_FIELDS = [
    (OptimizerConfig, "lr", {}),
    (OptimizerConfig, "weight_decay", {}),
    (OptimizerConfig, "clip_grad", {}),
    (OptimizerConfig, "foam_scale", {}),
    (LossConfig, "temperature", {}),
    (LossConfig, "ce_weight", {}),
    (LossConfig, "ratio_clip", {}),
    (LossConfig, "beta", {}),
    (ScheduleConfig, "min_lr_ratio", {}),
    (SparseFFNConfig, "l1", {"sparse_ffn": True}),
    (SparseFFNConfig, "dead_reinit", {"sparse_ffn": True}),
]


def test_the_list_holds_every_float_field():
    import dataclasses
    import typing

    listed = {(cls, name) for cls, name, _ in FLOAT_FIELDS}
    for cls in (OptimizerConfig, LossConfig, ScheduleConfig, SparseFFNConfig, LongContextConfig):
        hints = typing.get_type_hints(cls)
        floats = {f.name for f in dataclasses.fields(cls) if float in (hints[f.name], *typing.get_args(hints[f.name]))}
        assert {(cls, name) for name in floats} <= listed, cls


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("cls, name, extra", FLOAT_FIELDS, ids=[f"{c.__name__}.{n}" for c, n, _ in FLOAT_FIELDS])
def test_a_float_that_is_not_finite_is_refused_up_front(cls, name, extra, value):
    cls(**extra)  # the defaults are fine
    with pytest.raises(ConfigError, match=f"^`{name}` must be .*got {value!r}$") as error:
        cls(**extra, **{name: value})
    assert error.value.field == name


def test_the_optimizer_says_finite():
    with pytest.raises(ConfigError) as error:
        OptimizerConfig(lr=math.inf)
    assert str(error.value.as_option()) == "--lr must be a finite number > 0, got inf"
    assert str(error.value.in_section("train")) == "[train] lr must be a finite number > 0, got inf"
    OptimizerConfig(lr=1e-3, weight_decay=0.0, clip_grad=0.0, foam_scale=1.0)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: LongContextConfig(chunk_tokens=0),
         "`chunk_tokens` must be a positive integer, or leave it out, got 0"),
        (lambda: LongContextConfig(chunk_tokens=8, sparse_pages=0),
         "`sparse_pages` must be a positive integer, or leave it out, got 0"),
        (lambda: LongContextConfig(keep_attention_chunks=-1),
         "`keep_attention_chunks` must be an integer >= 0, or leave it out, got -1"),
        (lambda: ScheduleConfig(warmup_steps=-1), "`warmup_steps` must be an integer >= 0, or leave it out, got -1"),
        # a wrong type of an optional field (check_types)
        (lambda: LossConfig(temperature="2"), "`temperature` must be a number, or leave it out, got '2'"),
        (lambda: LongContextConfig(chunk_tokens=1.5), "`chunk_tokens` must be an integer, or leave it out, got 1.5"),
    ],
)
def test_an_optional_field_says_leave_it_out_not_none(make, message):
    with pytest.raises(ConfigError) as error:
        make()
    assert str(error.value) == message and "None" not in message
