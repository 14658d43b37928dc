"""Typed config fields reject values of the wrong type with one line naming `Class.field`
(`tpurl.config_types.check_types`), for every config gin can bind."""

import dataclasses
import re
import typing
from typing import Literal

import numpy as np
import pytest

from tpurl.checkpoint import CheckpointConfig
from tpurl.config_types import check_types
from tpurl.generate import EngineConfig, SamplingConfig
from tpurl.logging import LoggingConfig
from tpurl.models.config import RopeScaling, preset
from tpurl.rl.async_rollout import AsyncConfig
from tpurl.rl.config import EvalConfig, RLConfig, SFTConfig
from tpurl.sandbox import SandboxConfig
from tpurl.sharding.layout import Layout, MeshConfig
from tpurl.sharding.placement import PlacementConfig
from tpurl.sync import HandoverConfig, SyncConfig
from tpurl.tasks import AdditionConfig, MathConfig, TaskConfig
from tpurl.tasks.calculator import CalculatorConfig
from tpurl.tasks.env import EpisodeLimits
from tpurl.train.config import AlgorithmConfig, OptimizerConfig
from tpurl.train.packing import PackingConfig

# One valid instance of each config gin binds (the ones being removed from the RL config aside).
CONFIGS = [RopeScaling(), preset("tiny"), MeshConfig(), Layout(name="x"), SyncConfig(), HandoverConfig(),
           PlacementConfig(), RLConfig(), SFTConfig(), EvalConfig(), TaskConfig(), AdditionConfig(), MathConfig(),
           LoggingConfig(), CheckpointConfig(), AlgorithmConfig(), OptimizerConfig(),
           EngineConfig(max_slots=2, max_seq_len=16), SamplingConfig(), SandboxConfig(), CalculatorConfig(),
           EpisodeLimits(), PackingConfig(), AsyncConfig()]
# Fields with their own, more specific checks of the same thing.
OWN_CHECKS = {("MeshConfig", "axes"), ("MeshConfig", "shape"), ("Layout", "rules")}
WRONG = {int: [2.5, "3", True], float: ["0.5", False], bool: [1, "yes"], str: [3, 1.5]}


def _cases():
    for cfg in CONFIGS:
        hints = typing.get_type_hints(type(cfg))
        for field in dataclasses.fields(cfg):
            want = hints[field.name]
            if typing.get_args(want) and type(None) in typing.get_args(want):  # X | None: check X
                want = next(a for a in typing.get_args(want) if a is not type(None))
            if (type(cfg).__name__, field.name) in OWN_CHECKS:
                continue
            for bad in WRONG.get(want, []):
                yield pytest.param(cfg, field.name, bad, id=f"{type(cfg).__name__}.{field.name}={bad!r}")


@pytest.mark.parametrize("cfg, name, bad", list(_cases()))
def test_every_config_rejects_wrong_types(cfg, name, bad):
    with pytest.raises(ValueError) as e:
        dataclasses.replace(cfg, **{name: bad})
    msg = str(e.value)
    assert msg.startswith(f"{type(cfg).__name__}.{name}={bad!r} must be ") and "\n" not in msg


def test_enough_fields_are_covered():
    assert len(list(_cases())) > 150


@pytest.mark.parametrize("change, message", [
    (dict(steps=2.5), "RLConfig.steps=2.5 must be an int, not a float"),
    (dict(batch_size=16.0), "RLConfig.batch_size=16.0 must be an int, not a float"),
    (dict(steps="5"), "RLConfig.steps='5' must be an int, not a str"),
    (dict(batch_size=-16), "RLConfig.batch_size=-16 must be positive"),
    (dict(batch_size=0), "RLConfig.batch_size=0 must be positive"),
    (dict(eval=EvalConfig), "RLConfig.eval=<class"),
])
def test_rl_config_issue_cases(change, message):
    with pytest.raises(ValueError) as e:
        RLConfig(**change)
    assert str(e.value).startswith(message)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Example:
    count: int = 1
    rate: float = 0.5
    limit: int | None = None
    kind: Literal["a", "b"] = "a"
    sizes: tuple[int, ...] = ()
    pair: tuple[str, int] = ("x", 1)
    opt: OptimizerConfig = OptimizerConfig()

    def __post_init__(self):
        check_types(self)


@pytest.mark.parametrize("ok", [dict(rate=1), dict(limit=3), dict(sizes=[1, 2]), dict(sizes=(3,)), dict(kind="z"),
                                dict(pair=["y", 2]), dict(count=np.int64(2))])
def test_accepted(ok):
    _Example(**ok)


@pytest.mark.parametrize("bad, message", [
    (dict(rate=True), "_Example.rate=True must be a number, not a bool"),
    (dict(limit=2.0), "_Example.limit=2.0 must be an int or None, not a float"),
    (dict(kind=1), "_Example.kind=1 must be one of 'a', 'b', not an int"),
    (dict(sizes=(1, 2.0)), "_Example.sizes=(1, 2.0) must be a tuple of ints, not a tuple of float and int"),
    (dict(pair=("y",)), "_Example.pair=('y',) must be a tuple (a str, an int), not a tuple of str"),
    (dict(opt={"lr": 1.0}), "_Example.opt={'lr': 1.0} must be an OptimizerConfig, not a dict"),
])
def test_rejected(bad, message):
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        _Example(**bad)
