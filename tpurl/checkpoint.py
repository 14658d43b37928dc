"""Checkpoint / resume of an RL run with orbax, and the final Hugging Face export.

A checkpoint holds everything needed to continue a run bit-for-bit: the train state (params,
optimizer state, step), the reference policy when one is used and, as JSON metadata, the data
cursor, the policy version and anything else the loop needs. No RNG state is saved: every sampling
key is derived from the run's seed and the step (`tpurl.rl.step.step_seed`). Arrays are saved
as one flat dict of leaves (`leaf_00000`, ...) so that any pytree (nnx.State, optax states) round
trips without orbax having to understand its node types; the leaf paths are stored next to them and
checked on restore, so a checkpoint restored into a different structure fails loudly.

Saves are synchronous and atomic: orbax writes into a temporary directory and renames it when the
save is complete, so a run killed mid-save leaves the previous checkpoint as the latest one.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from tpurl.config_types import check_types


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """`every_steps=0` disables periodic checkpoints (the final state is still exported)."""

    every_steps: int = 0
    max_to_keep: int = 2
    export_hf: bool = True

    def __post_init__(self):
        check_types(self)
        if self.every_steps < 0:
            raise ValueError(f"CheckpointConfig.every_steps={self.every_steps} must be >= 0 (0 disables)")
        if self.max_to_keep < 1:
            raise ValueError(f"CheckpointConfig.max_to_keep={self.max_to_keep} must be >= 1")


def _flatten(tree) -> tuple[dict[str, Any], list[str]]:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return ({f"leaf_{i:05d}": leaf for i, (_, leaf) in enumerate(leaves)},
            [jax.tree_util.keystr(path) for path, _ in leaves])


def _abstract(x):
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    if isinstance(x, jax.Array):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    arr = np.asarray(x)
    return jax.ShapeDtypeStruct(arr.shape, arr.dtype)


class Checkpointer:
    """Saves and restores `(arrays pytree, json metadata)` pairs under `directory/<step>`."""

    def __init__(self, directory: str, *, max_to_keep: int = 2):
        self.directory = os.path.abspath(directory)
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, enable_async_checkpointing=False,
                                               create=True)
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def save(self, step: int, tree, meta: dict[str, Any]) -> None:
        """Write checkpoint `step` (blocks until it is durable)."""
        arrays, paths = _flatten(tree)
        self._manager.save(step, args=ocp.args.Composite(
            arrays=ocp.args.StandardSave(arrays),
            meta=ocp.args.JsonSave({"meta": meta, "paths": paths})), force=True)
        self._manager.wait_until_finished()

    def restore(self, step: int, like) -> tuple[Any, dict[str, Any]]:
        """Restore checkpoint `step` into the structure, dtypes and shardings of `like` (a pytree of
        arrays or `ShapeDtypeStruct`s with shardings). Returns `(tree, meta)`."""
        if step not in self._manager.all_steps():
            raise FileNotFoundError(f"no checkpoint for step {step} in {self.directory}; "
                                    f"available: {self.all_steps()}")
        abstract, paths = _flatten(jax.tree.map(_abstract, like))
        saved = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        if saved["paths"] != paths:
            diff = sorted(set(saved["paths"]) ^ set(paths))[:5]
            raise ValueError(f"checkpoint {self.directory}/{step} has a different structure than the run "
                             f"({len(saved['paths'])} vs {len(paths)} leaves; differing: {diff}); "
                             "resume with the config the checkpoint was written with")
        out = self._manager.restore(step, args=ocp.args.Composite(arrays=ocp.args.StandardRestore(abstract)))
        leaves = [out["arrays"][k] for k in sorted(out["arrays"])]
        treedef = jax.tree_util.tree_structure(like)
        return jax.tree_util.tree_unflatten(treedef, leaves), saved["meta"]

    def close(self) -> None:
        self._manager.close()


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def export_hf(model, directory: str, *, tokenizer_dir: str | None = None) -> str:
    """Write the policy as a Hugging Face checkpoint (config.json + safetensors) loadable by
    `transformers`, with the tokenizer files of `tokenizer_dir` (those of `TOKENIZER_FILES` that
    exist) next to it, so that the export is a complete model directory; returns the directory."""
    from tpurl.models.hf import save_hf_checkpoint

    save_hf_checkpoint(model, directory)
    for name in TOKENIZER_FILES if tokenizer_dir else ():
        src = os.path.join(tokenizer_dir, name)
        if os.path.exists(src):
            tmp = os.path.join(directory, f".{name}.tmp")
            shutil.copyfile(src, tmp)
            os.replace(tmp, os.path.join(directory, name))  # never a half-written file
    return directory
