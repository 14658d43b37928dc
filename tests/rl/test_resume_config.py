"""`--resume` under the config its checkpoint was written with: any change that alters what the
run computes is refused in one line listing it, unless named; record-keeping changes are said."""

import pytest

from tpurl.rl.config import RLConfig
from tpurl.rl.resume import check_resume_config, config_changes, config_record
from tpurl.train.config import OptimizerConfig
from tpurl.checkpoint import CheckpointConfig
from tpurl.logging.metrics import LoggingConfig

BASE = RLConfig(steps=10, seed=0)


def _check(saved, current, allowed=()):
    said = []
    check_resume_config(config_record(saved), config_record(current), step=4, allowed=allowed, say=said.append)
    return said


def test_the_same_config_resumes_silently():
    assert _check(BASE, RLConfig(steps=10, seed=0)) == []
    assert config_changes(config_record(BASE), config_record(BASE)) == {}


@pytest.mark.parametrize("current, listed", [
    (RLConfig(steps=10, seed=1), "seed 0 -> 1"),
    (RLConfig(steps=10, seed=0, optimizer=OptimizerConfig(lr=2e-5)), "optimizer.lr 0.0001 -> 2e-05"),
])
def test_a_changed_result_field_is_refused_in_one_line(current, listed):
    with pytest.raises(ValueError) as e:
        _check(BASE, current)
    field = listed.split()[0]
    assert str(e.value) == (f"the config differs from the one checkpoint step 4 was written with: {listed}; resume "
                            f"with that config, or name the changes you intend with --resume-changed {field}")


def test_named_changes_and_record_keeping_pass_and_are_said():
    current = RLConfig(steps=20, seed=0, optimizer=OptimizerConfig(lr=2e-5),
                       checkpoint=CheckpointConfig(every_steps=5), logging=LoggingConfig(run_dir="elsewhere"))
    with pytest.raises(ValueError, match=r"written with: optimizer.lr 0.0001 -> 2e-05; steps 10 -> 20;.*"
                                         r"--resume-changed optimizer.lr,steps$"):
        _check(BASE, current)
    said = _check(BASE, current, allowed=("steps", "optimizer"))  # a section names everything in it
    assert len(said) == 1 and said[0].startswith("resuming from checkpoint step 4 with changed config: ")
    for change in ("checkpoint.every_steps 50 -> 5", "optimizer.lr 0.0001 -> 2e-05", "steps 10 -> 20"):
        assert change in said[0]


def test_a_setting_this_version_no_longer_has_is_a_change():
    """A checkpoint written with `algorithm.tis_cap=2.0` (now `algorithm.correction`) does not resume
    silently without its correction; one left at None is no change."""
    saved = config_record(BASE)
    saved["algorithm"] = {**saved["algorithm"], "tis_cap": 2.0}
    with pytest.raises(ValueError, match=r"written with: algorithm.tis_cap 2.0 -> null; .*--resume-changed algorithm$"):
        check_resume_config(saved, config_record(BASE), step=4, say=print)
    said = []
    check_resume_config(saved, config_record(BASE), step=4, allowed=("algorithm",), say=said.append)
    assert len(said) == 1 and "algorithm.tis_cap 2.0 -> null" in said[0]
    saved["algorithm"]["tis_cap"] = None
    assert config_changes(saved, config_record(BASE)) == {}


@pytest.mark.parametrize("direction", ["added", "removed"])
def test_a_setting_between_none_and_a_config_is_one_change(direction):
    """`model.rope_scaling` None on one side and a config on the other: one change, either way."""
    plain = config_record(BASE)
    scaled = config_record(BASE)
    scaled["model"] = {**scaled["model"], "rope_scaling": {"factor": 8.0, "rope_type": "llama3"}}
    assert plain["model"]["rope_scaling"] is None
    saved, current = (plain, scaled) if direction == "added" else (scaled, plain)
    changes = config_changes(saved, current)
    assert list(changes) == ["model.rope_scaling"]
    assert changes["model.rope_scaling"] == (saved["model"]["rope_scaling"], current["model"]["rope_scaling"])


def test_a_misspelt_permission_is_an_error():
    with pytest.raises(ValueError, match=r"^--resume-changed names 'optimiser.lr', which is not a field"):
        _check(BASE, BASE, allowed=("optimiser.lr",))
    with pytest.raises(ValueError, match="'optimizer.l'"):  # a prefix of a name is not a section
        _check(BASE, BASE, allowed=("optimizer.l",))


def test_a_checkpoint_without_a_config_is_said():
    said = []
    check_resume_config(None, config_record(BASE), step=4, say=said.append)
    assert said == ["checkpoint step 4 records no config, so this run's config cannot be compared with it"]


@pytest.mark.slow
def test_a_derived_setting_is_no_change(tmp_path):
    """Dr. GRPO derives its loss normaliser from the task's lengths (`loss_norm_len=None` in the
    config): the config as given is recorded and compared, so its resume is not refused."""
    from algo_helpers import tiny_rl_config
    from tpurl.rl.loop import run
    from tpurl.train.config import algorithm_preset

    cfg = tiny_rl_config(tmp_path / "run", algorithm_preset("dr_grpo", group_size=4),
                         checkpoint=CheckpointConfig(every_steps=1, export_hf=False))
    assert cfg.algorithm.loss_norm_len is None
    run(cfg, verbose=False)
    resumed = run(cfg.replace(steps=2), resume=True, allow_changed=("steps",), verbose=False)
    assert resumed.resumed_from == 1 and resumed.steps == 2


def test_functions_in_options_are_recorded_by_import_path():
    """A gin reference (a function or class) in `TaskConfig.options` is recorded by its import path,
    the same in every process and run, not by its address."""
    from tpurl.rl.resume import _json_value

    assert _json_value(config_changes) == "tpurl.rl.resume:config_changes" and _json_value(RLConfig) == \
        "tpurl.rl.config:RLConfig"
