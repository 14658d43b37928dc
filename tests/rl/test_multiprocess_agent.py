"""An agent task across processes (2 processes x 4 CPU devices, `tpurl launch`, gloo) against the
same run in one process over 8 devices: the endpoint and the agents (examples/agent's calculator,
against the real `openai` client) run on process 0, both processes run the engine's batch with
process 0's requests (`tpurl.generate.lockstep`) and pack process 0's sequences. The trajectories
(every call the agents made, the ids, the rewards) and the evaluations must be the same as in one
process; the metrics equal up to the order of cross-device reductions (tests/rl/test_multiprocess_run.py)."""

import os

import pytest

from multiprocess_helpers import ROOT
from test_multiprocess_run import GIN, _assert_equal_up_to_reduction_order, _env, _finish, _logs, _start

pytestmark = pytest.mark.slow  # whole runs, subprocesses or several processes

AGENT = ["train", "--quiet", "--gin_file", GIN,
         "--gin_param", "tpurl.RLConfig.steps=2", "--gin_param", "tpurl.EvalConfig.pass_k=1",
         "--gin_param", "tpurl.TaskConfig.name='agent'",
         "--gin_param", "tpurl.TaskConfig.calculator=@tpurl.CalculatorConfig()",
         "--gin_param", "tpurl.CalculatorConfig.digits=1", "--gin_param", "tpurl.CalculatorConfig.num_eval=4",
         "--gin_param", "tpurl.TaskConfig.agent=@tpurl.AgentConfig()",
         "--gin_param", "tpurl.AgentConfig.agent='my_agents.calculator:solve'",
         "--gin_param", "tpurl.AgentConfig.source='calculator'",
         "--gin_param", "tpurl.AgentConfig.reward_weights={'correct': 1.0}",
         "--gin_param", "tpurl.AgentConfig.max_prompt_tokens=8", "--gin_param", "tpurl.AgentConfig.max_new_tokens=24"]


def _agent_env(devices: int) -> dict[str, str]:
    env = _env(devices)
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "examples", "agent"), env.get("PYTHONPATH", "")])
    return env


def _trajectories(run_dir) -> list[dict]:
    """The trajectories without the seconds each agent ran (a clock)."""
    out = _logs(run_dir, "trajectories.jsonl")
    for t in out:
        t["info"]["agent"].pop("seconds")
    return out


def test_agents_on_process_0_match_one_process(tmp_path):
    multi, single = tmp_path / "multi", tmp_path / "single"
    reference = _start([*AGENT, "--gin_param", f"tpurl.LoggingConfig.run_dir='{single}'"], _agent_env(8))
    try:
        _finish(_start(["launch", "-n", "2", "--devices-per-process", "4", "--", *AGENT,
                        "--gin_param", f"tpurl.LoggingConfig.run_dir='{multi}'"], _agent_env(4)))
    except BaseException:  # never leave the one-process run behind
        reference.kill()
        reference.communicate()
        raise
    _finish(reference)
    traj = _trajectories(multi)
    assert len(traj) == 2 * 16 and all(t["info"]["agent"]["calls"] for t in traj)
    assert traj == _trajectories(single)
    assert _logs(multi, "eval.jsonl") == _logs(single, "eval.jsonl")
    _assert_equal_up_to_reduction_order(_logs(multi, "metrics.jsonl"), _logs(single, "metrics.jsonl"))
