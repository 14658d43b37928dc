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
from tpurl.logging import LoggingConfig, MlflowConfig, WandbConfig
from tpurl.models.config import RopeScaling, preset
from tpurl.rl.async_rollout import AsyncConfig
from tpurl.rl.config import EvalConfig, RLConfig, SFTConfig
from tpurl.sandbox import SandboxConfig
from tpurl.sharding.layout import Layout, MeshConfig
from tpurl.sharding.placement import PlacementConfig
from tpurl.sync import HandoverConfig, SyncConfig
from tpurl.tasks import AdditionConfig, CustomConfig, MathConfig, TaskConfig
from tpurl.tasks.calculator import CalculatorConfig
from tpurl.tasks.env import EpisodeLimits
from tpurl.train.config import AlgorithmConfig, OptimizerConfig
from tpurl.train.packing import PackingConfig

# One valid instance of each config gin binds (the ones being removed from the RL config aside).
CONFIGS = [RopeScaling(), preset("tiny"), MeshConfig(), Layout(name="x"), SyncConfig(), HandoverConfig(),
           PlacementConfig(), RLConfig(), SFTConfig(), EvalConfig(), TaskConfig(), AdditionConfig(), MathConfig(), CustomConfig(),
           LoggingConfig(), CheckpointConfig(), AlgorithmConfig(), OptimizerConfig(),
           EngineConfig(max_slots=2, max_seq_len=16), SamplingConfig(), SandboxConfig(), CalculatorConfig(),
           EpisodeLimits(), PackingConfig(), AsyncConfig(), WandbConfig(), MlflowConfig()]
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


def _float_fields():
    for cfg in CONFIGS:
        hints = typing.get_type_hints(type(cfg))
        for field in dataclasses.fields(cfg):
            if float in (hints[field.name], *typing.get_args(hints[field.name])):
                for bad in (float("inf"), float("-inf"), float("nan")):
                    yield pytest.param(cfg, field.name, bad, id=f"{type(cfg).__name__}.{field.name}={bad}")


@pytest.mark.parametrize("cfg, name, bad", list(_float_fields()))
def test_every_float_field_rejects_non_finite_values(cfg, name, bad):
    """`lr=1e999` (inf in gin) used to train to the end on NaN losses; no config uses inf as a sentinel."""
    with pytest.raises(ValueError) as e:
        dataclasses.replace(cfg, **{name: bad})
    assert str(e.value) == f"{type(cfg).__name__}.{name}={bad!r} must be a finite number"


def test_float_fields_are_covered():
    assert len({(c.values[0].__class__, c.values[1]) for c in _float_fields()}) >= 30


def test_non_finite_items_of_a_tuple():
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class _Rates:
        rates: tuple[float, ...] = ()

        def __post_init__(self):
            check_types(self)

    with pytest.raises(ValueError, match=r"^_Rates.rates=\(1.0, nan\) must be a finite number$"):
        _Rates(rates=(1.0, float("nan")))


@pytest.mark.parametrize("cfg", [RLConfig(), AdditionConfig(), MathConfig(), CalculatorConfig()],
                         ids=lambda c: type(c).__name__)
@pytest.mark.parametrize("seed", [2**70, 2**63, -1])
def test_seeds_numpy_and_jax_cannot_take(cfg, seed):
    """`RLConfig.seed=2**70` was an OverflowError traceback inside JAX's PRNG; -1 one inside numpy."""
    with pytest.raises(ValueError) as e:
        dataclasses.replace(cfg, seed=seed)
    assert str(e.value) == f"{type(cfg).__name__}.seed={seed} must be in [0, 2**63): a seed numpy and JAX can both take"
    dataclasses.replace(cfg, seed=2**63 - 1)


def test_ints_beyond_64_bits():
    with pytest.raises(ValueError, match=r"^RLConfig.steps=1180591620717411303424 does not fit in 64 bits"):
        RLConfig(steps=2**70)


@pytest.mark.parametrize("make, field", [
    (lambda t: SamplingConfig(temperature=t), "SamplingConfig.temperature"),
    (lambda t: AlgorithmConfig(temperature=t), "AlgorithmConfig('grpo').temperature"),
    (lambda t: EvalConfig(temperature=t), "EvalConfig.temperature"),
])
@pytest.mark.parametrize("t", [1e-300, 5e-5, 1e5, 1e39])
def test_temperatures_that_are_greedy_or_uniform_in_all_but_name(make, field, t):
    """1e-300 is 0 in float32, where the sampler read it as T = 1; 1e39 is inf (uniform sampling)."""
    with pytest.raises(ValueError, match=rf"^{re.escape(field)}={re.escape(repr(t))} must be (0 \(greedy\) or )?in \[0.0001, 10000\]"):
        make(t)
    make(1e-4), make(1e4)


def test_greedy_is_zero_only_where_sampling_may_be_greedy():
    assert SamplingConfig(temperature=0.0).greedy
    for make in (lambda: AlgorithmConfig(temperature=0.0), lambda: EvalConfig(temperature=0.0)):
        with pytest.raises(ValueError, match="temperature=0.0 must be in"):
            make()


@pytest.mark.parametrize("timeout", [1e300, 86400.5])
def test_grading_timeout_beyond_a_day(timeout):
    """`--timeout inf` was an OverflowError traceback, 1e300 a 'no way to run sandboxed Python' error."""
    with pytest.raises(ValueError, match=r"^SandboxConfig.timeout_s=.* must be > 0 and at most 86400 seconds"):
        SandboxConfig(timeout_s=timeout)
    with pytest.raises(ValueError, match=r"^SandboxConfig.cpu_seconds=86401 must be in \[1, 86400\]"):
        SandboxConfig(cpu_seconds=86401)


def test_an_annotation_that_does_not_hash_is_not_checked_and_the_others_are():
    @dataclasses.dataclass
    class Odd:
        a: [int] = 1  # not a type an annotation should be, but legal Python: left unchecked
        b: int = 2

    check_types(Odd(a="x"))
    with pytest.raises(ValueError, match=r"^Odd.b=True must be an int, not a bool$"):
        check_types(Odd(b=True))
