"""Algorithm presets: the gin files equal the Python presets; bad configs fail with one clear line."""

import pathlib

import gin
import pytest

from tpurl.commands.gin_config import parse_gin
from tpurl.train.config import ALGORITHMS, AlgorithmConfig, OptimizerConfig, algorithm_preset

GIN_DIR = pathlib.Path(__file__).resolve().parents[2] / "configs" / "algorithms"


def test_every_preset_has_a_gin_file_and_vice_versa():
    assert {p.stem for p in GIN_DIR.glob("*.gin")} == set(ALGORITHMS)
    assert {"grpo", "dr_grpo", "dapo", "gspo", "rloo", "reinforce_pp", "ppo"} <= set(ALGORITHMS)


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_gin_file_equals_python_preset(name):
    try:
        parse_gin([str(GIN_DIR / f"{name}.gin")])
        got = gin.get_configurable("tpurl.AlgorithmConfig")()
    finally:
        gin.clear_config()
    assert got == algorithm_preset(name)


def test_preset_by_gin_factory_with_overrides():
    try:
        parse_gin(bindings=["tpurl.algorithm_preset.name = 'dapo'", "tpurl.algorithm_preset.kl_coef = 0.01"])
        got = gin.get_configurable("tpurl.algorithm_preset")()
    finally:
        gin.clear_config()
    assert got == ALGORITHMS["dapo"].replace(kl_coef=0.01) and got.uses_reference


def test_presets_encode_their_algorithms():
    dapo = algorithm_preset("dapo")
    assert dapo.eps_high > dapo.eps_low and dapo.dynamic_sampling
    assert algorithm_preset("dr_grpo").loss_agg == "seq-mean-token-sum-norm"
    assert algorithm_preset("gspo").loss_type == "gspo" and algorithm_preset("ppo").uses_critic
    assert not algorithm_preset("dapo").uses_reference and algorithm_preset("grpo").uses_reference
    assert algorithm_preset("DR-GRPO") == ALGORITHMS["dr_grpo"]


def test_unknown_algorithm_lists_known_ones():
    with pytest.raises(ValueError, match=r"unknown algorithm 'trpo'; known algorithms: cispo, dapo, dr_grpo"):
        algorithm_preset("trpo")


@pytest.mark.parametrize("kwargs,field", [
    (dict(loss_agg="mean"), "loss_agg"),
    (dict(advantage_estimator="vtrace"), "advantage_estimator"),
    (dict(kl_estimator="k4"), "kl_estimator"),
    (dict(dual_clip=0.5), "dual_clip"),
    (dict(loss_type="gspo", dual_clip=3.0), "dual_clip"),
    (dict(group_size=1), "group_size"),
    (dict(advantage_estimator="reinforce_pp", group_size=1), "reinforce_pp_baseline"),
    (dict(loss_agg="seq-mean-token-sum-norm", loss_norm_len=0), "loss_norm_len"),
    (dict(advantage_estimator="gae"), "value_coef"),
    (dict(micro_batches=0), "micro_batches"),
])
def test_bad_algorithm_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field) as err:
        AlgorithmConfig(**kwargs)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("kwargs,field", [(dict(lr=0.0), "lr"), (dict(schedule="linear"), "schedule"),
                                          (dict(optimizer="lion"), "optimizer"),
                                          (dict(max_grad_norm=0.0), "max_grad_norm")])
def test_bad_optimizer_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        OptimizerConfig(**kwargs)


def test_single_sample_reinforce_pp_and_dr_grpo_normalizer():
    # REINFORCE++ with one sample per prompt is fine without the group baseline (batch mean).
    assert AlgorithmConfig(advantage_estimator="reinforce_pp", group_size=1, reinforce_pp_baseline=False)
    # Dr. GRPO's preset leaves its constant normalizer to the run (the rollout's max_new_tokens).
    assert algorithm_preset("dr_grpo").loss_norm_len is None
