"""A multi-turn environment across processes (2 processes x 4 CPU devices, `tpurl launch`, gloo)
against the same run in one process over 8 devices: the calculator, whose episodes call a tool
between model turns. Only process 0 runs the environments and the graders; which episodes
answered at a decode step, their observations and the rewards go to the other process over the
rollout devices, so both resume the same sequences with the same tokens. A file of its own, so that
the test runner can run it beside the other multi-process runs."""

from test_multiprocess_run import ARGS, _assert_equal_up_to_reduction_order, _env, _finish, _logs, _start, _two_processes

CALCULATOR = ["--gin_param", "tpurl.TaskConfig.name='calculator'",
              "--gin_param", "tpurl.TaskConfig.calculator=@tpurl.CalculatorConfig()",
              "--gin_param", "tpurl.CalculatorConfig.digits=1", "--gin_param", "tpurl.CalculatorConfig.num_eval=8",
              "--gin_param", "tpurl.CheckpointConfig.every_steps=0", "--gin_param", "tpurl.CheckpointConfig.export_hf=False"]


def test_multi_turn_episodes_across_processes_match_one(tmp_path):
    multi, single = tmp_path / "multi", tmp_path / "single"
    reference = _start([*ARGS, "--gin_param", f"tpurl.LoggingConfig.run_dir='{single}'", *CALCULATOR], _env(8))
    _finish(_two_processes(multi, None, *CALCULATOR))
    _finish(reference)
    trajectories = _logs(multi, "trajectories.jsonl")
    assert trajectories == _logs(single, "trajectories.jsonl")
    called = [t for t in trajectories if t["turns"] > 1]
    assert called and all(not all(t["model_mask"]) for t in called)  # tool turns, masked out of the loss
    assert _logs(multi, "eval.jsonl") == _logs(single, "eval.jsonl")
    _assert_equal_up_to_reduction_order(_logs(multi, "metrics.jsonl"), _logs(single, "metrics.jsonl"))
