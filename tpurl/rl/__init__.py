"""The RL loop: config, runtime (meshes, the rollout side, jitted steps), the phased step (and its
asynchronous form), warm start, held-out evaluation and the driver (`run`)."""

from tpurl.rl.async_rollout import AsyncConfig
from tpurl.rl.config import EvalConfig, RLConfig, SFTConfig, validate
from tpurl.rl.dynamic import DynamicSamplingConfig, collect_rollouts
from tpurl.rl.loop import RunResult, prepare, report, run
from tpurl.rl.rollout import Rollout
from tpurl.rl.runtime import RLRuntime
from tpurl.rl.shaping import loss_norm_for_rollout, make_advantage_fn
from tpurl.rl.step import LoopState, rl_step
from tpurl.rl.timeline import Timeline

__all__ = ["AsyncConfig", "EvalConfig", "RLConfig", "SFTConfig", "validate", "RunResult", "prepare", "report", "run",
           "RLRuntime", "Rollout", "LoopState", "rl_step", "Timeline", "DynamicSamplingConfig", "collect_rollouts",
           "loss_norm_for_rollout", "make_advantage_fn"]
