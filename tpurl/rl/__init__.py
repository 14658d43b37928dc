"""The RL loop: config, runtime (meshes, the rollout side, jitted steps), the phased step (and its
asynchronous form), warm start, held-out evaluation and the driver (`run`)."""

from tpurl.rl.advantage_phase import make_advantage_fn
from tpurl.rl.async_rollout import AsyncConfig
from tpurl.rl.collect import collect_rollouts
from tpurl.rl.config import EvalConfig, RLConfig, SFTConfig
from tpurl.rl.loop import RunResult, prepare, report, run
from tpurl.rl.rollout import RolloutSide
from tpurl.rl.runtime import RLRuntime
from tpurl.rl.spec import RunSpec, TaskLengths, resolve_run
from tpurl.rl.step import LoopState, rl_step
from tpurl.rl.timeline import Timeline

__all__ = ["AsyncConfig", "EvalConfig", "RLConfig", "SFTConfig", "RunSpec", "TaskLengths", "resolve_run", "RunResult", "prepare", "report", "run",
           "RLRuntime", "RolloutSide", "LoopState", "rl_step", "Timeline", "collect_rollouts",
           "make_advantage_fn"]
