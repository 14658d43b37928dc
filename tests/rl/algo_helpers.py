"""Shared helpers of the algorithm-coverage tests: a tiny RL config, a fresh loop state and a spy
on the update batches (no imports from conftest or other test modules)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from tpurl.checkpoint import CheckpointConfig
from tpurl.logging import LoggingConfig
from tpurl.models import preset
from tpurl.rl.config import EvalConfig, RLConfig, SFTConfig
from tpurl.rl.step import LoopState
from tpurl.sharding.layout import MeshConfig
from tpurl.sharding.placement import PlacementConfig
from tpurl.tasks import AdditionConfig, TaskConfig
from tpurl.train.config import OptimizerConfig
from tpurl.train.packing import INDEX_KEY, PACKED_KEYS

MESH3 = ("data", "fsdp", "tensor")


def tiny_rl_config(run_dir, algorithm, **overrides) -> RLConfig:
    """An 8-sequence step of a 2-layer model on 1-digit addition, colocated on 8 fake devices."""
    base = dict(
        seed=0, steps=1, batch_size=8,
        model=preset("tiny", hidden_size=32, intermediate_size=64, head_dim=8, num_heads=4, num_kv_heads=2),
        task=TaskConfig(addition=AdditionConfig(digits=1, num_eval=4, reverse_answer=True)),
        algorithm=algorithm, optimizer=OptimizerConfig(lr=1e-3),
        placement=PlacementConfig(train_mesh=MeshConfig(axes=MESH3, shape=(1, 4, 2)),
                                  rollout_mesh=MeshConfig(axes=MESH3, shape=(2, 1, 4))),
        sft=SFTConfig(steps=0), eval=EvalConfig(pass_k=1),
        checkpoint=CheckpointConfig(every_steps=0, export_hf=False),
        logging=LoggingConfig(run_dir=str(run_dir), trajectory_sample_rate=1.0, progress_bar=False, trackers=()),
    )
    base.update(overrides)
    return RLConfig(**base)


def fresh_state(rt, *, ref_seed: int | None = None) -> LoopState:
    """A step-0 loop state; `ref_seed` draws the reference policy from another initialization, so
    that KL(policy || reference) is not zero at the first step."""
    params = rt.init_params(rt.cfg.seed)
    train = rt.new_train_state(params)
    ref = None
    if rt.keeps_reference:
        ref = rt.init_params(ref_seed) if ref_seed is not None else jax.tree.map(jnp.copy, train.params)
    rt.rollout.load(train.params, version=0, frozen=train.frozen)  # frozen: a LoRA run's base
    return LoopState(train=train, ref_params=ref, step=0, cursor=0, policy_version=0)


class BatchSpy:
    """Wraps `rt.train_step`, keeping a host copy of every update batch it is given (a packed
    batch as the padded host batch it was prepared from, which the step takes as well)."""

    def __init__(self, rt):
        self.batches: list[dict[str, np.ndarray]] = []
        self._step = rt.train_step
        self._rows: dict[str, np.ndarray] = {}
        rt.train_step = self

    def prepare(self, rows):
        self._rows = {k: np.array(v) for k, v in rows.items()}
        return self._step.prepare(rows)

    def __getattr__(self, name):  # the wrapped step's other attributes (`lower`, `shapes`)
        return getattr(self._step, name)

    def __call__(self, state, batch):
        host = {k: np.array(v) for k, v in batch.items()}
        if "tokens" not in host:  # packed: the padded rows it was prepared from, as a host batch
            host = {**self._rows, **{k: v for k, v in host.items() if k not in (*PACKED_KEYS, INDEX_KEY)}}
        self.batches.append(host)
        return self._step(state, batch)


def count_scoring_calls(rt) -> list:
    """Wraps `rt.logprob_fn.on_batch` (the policy's and, sharing it, the reference's scoring pass):
    the returned list gets each call's arguments. The wrapper keeps the pass's `shapes`, which
    the step reads besides calling it."""
    calls, on_batch = [], rt.logprob_fn.on_batch

    def counted(*args):
        calls.append(args)
        return on_batch(*args)

    counted.shapes = on_batch.shapes
    rt.logprob_fn.on_batch = counted
    return calls


def assert_routes_all_but_last(batch, sparse_layers: int = 2, top_k: int = 2) -> None:
    """A router-replay update batch's routes: every token of a row but its last has its experts
    (`[Ls, K]`), the last and the padding -1."""
    routes, valid = batch["routes"], batch["valid"]
    assert routes.shape == (*valid.shape, sparse_layers, top_k)
    for b in range(valid.shape[0]):
        n = int(valid[b].sum())
        assert (routes[b, :n - 1] >= 0).all() and (routes[b, n - 1:] == -1).all()


def episode_gae(reward, kl, values, gamma, lam):
    """GAE of one trajectory's tokens (float64): per-token rewards -kl, the reward added on the
    last token, the state after it terminal; `(advantages, returns)`."""
    r = -np.asarray(kl, np.float64)
    r[-1] += reward
    adv, a, next_v = np.zeros(len(r)), 0.0, 0.0
    for k in reversed(range(len(r))):
        a = r[k] + gamma * next_v - values[k] + gamma * lam * a
        adv[k], next_v = a, values[k]
    return adv, adv + values
