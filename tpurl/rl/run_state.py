"""Where a run's state comes from and goes: fresh (initialized, warm-started), restored from a
checkpoint, saved to one, and exported at the end.

A checkpoint holds the train state (a LoRA run's frozen base included: the warm start may have
trained it), the reference weights when the run keeps its own (`RLRuntime.keeps_reference`), and
the loop's step, data cursor and policy version. Whatever the state's origin, the rollout weights
are synced from it before it is returned (a LoRA run's base with them, `RolloutSide.load`).
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from tpurl.checkpoint import Checkpointer, export_hf
from tpurl.models.transformer import abstract_model
from tpurl.rl.config import RLConfig
from tpurl.rl.runtime import RLRuntime
from tpurl.rl.sft import warm_start
from tpurl.rl.step import LoopState

EXPORT_DIR = "export"
ADAPTER_DIR = "adapter"  # a LoRA run's PEFT adapter, inside the export


def checkpoint_tree(train, ref) -> dict[str, Any]:
    return {"train": train} if ref is None else {"train": train, "ref": ref}


def save_state(ck: Checkpointer, state: LoopState, extra: dict[str, Any]) -> None:
    ck.save(state.step, checkpoint_tree(state.train, state.ref_params),
            {"step": state.step, "cursor": state.cursor, "policy_version": state.policy_version, **extra})


def restore_state(rt: RLRuntime, ck: Checkpointer, say) -> tuple[int, LoopState, dict[str, Any]]:
    """The newest checkpoint that restores (a damaged one is moved aside, `Checkpointer.restore_latest`),
    restored into an abstract template of the run's state (shapes, dtypes and shardings only: no
    model is loaded and no optimizer state built first); the rollout weights are synced from it.
    Returns `(step, state, meta)`."""
    train = rt.abstract_train_state()
    # A skipped (damaged) checkpoint is reported even when quiet.
    step, tree, meta = ck.restore_latest(checkpoint_tree(train, train.params if rt.keeps_reference else None),
                                         say=say)
    rt.rollout.load(tree["train"].params, version=meta["policy_version"], frozen=tree["train"].frozen)
    state = LoopState(train=tree["train"], ref_params=tree.get("ref"), step=meta["step"], cursor=meta["cursor"],
                      policy_version=meta["policy_version"])
    return step, state, meta


def fresh_state(rt: RLRuntime, cfg: RLConfig, say, on_sft_step=None) -> tuple[LoopState, dict[str, float]]:
    params = rt.init_params(cfg.seed)
    sft_metrics: dict[str, float] = {}
    cursor = 0
    if cfg.sft.steps:
        target = cfg.sft.stop_at_accuracy
        say(f"warm start: up to {cfg.sft.steps} SFT steps x {cfg.sft.batch_size} problems"
            + (f", stopping once {target:.0%} of {cfg.sft.probe_problems} training problems are solved"
               if target else ""))
        params, cursor, sft_metrics = warm_start(rt, params, cursor, on_step=on_sft_step)
        if "sft/steps_run" in sft_metrics:
            say(f"warm start stopped after {int(sft_metrics['sft/steps_run'])} steps "
                f"(training-probe accuracy {sft_metrics['sft/probe_accuracy']:.1%})")
    train = rt.new_train_state(params)
    ref = jax.tree.map(jnp.copy, train.params) if rt.keeps_reference else None
    rt.rollout.load(train.params, version=0, frozen=train.frozen)
    return LoopState(train=train, ref_params=ref, step=0, cursor=cursor, policy_version=0), sft_metrics


def export_policy(rt: RLRuntime, state: LoopState, run_dir: str) -> str | None:
    """The final policy as a Hugging Face checkpoint (streamed one parameter at a time); a LoRA
    run's as its base and, in `adapter/` beside it, its PEFT adapter (`tpurl.models.peft`)."""
    if not rt.cfg.checkpoint.export_hf:
        return None
    directory = os.path.join(run_dir, EXPORT_DIR)
    if rt.lora is None:
        return export_hf(nnx.merge(rt.graphdef, state.train.params), directory, tokenizer_dir=rt.spec.task.tokenizer)
    from tpurl.models.peft import save_peft_adapter

    base = rt.model_cfg.replace(lora=None, param_dtype=rt.lora.base_dtype)
    export_hf(nnx.merge(nnx.graphdef(abstract_model(base)), state.train.frozen), directory,
              tokenizer_dir=rt.spec.task.tokenizer)
    save_peft_adapter(state.train.params, rt.model_cfg, os.path.join(directory, ADAPTER_DIR), base_model=directory)
    return directory
