"""The run manifest: everything needed to say what a run was and to reproduce it.

Fields (see `MANIFEST_KEYS`): tpurl version and git commit, library versions, backend and
devices, model config, parameter count and checksum, task and grader name and version, the full
operative gin config, the seed, the command line and start time. Written atomically.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import importlib.metadata
import os
import platform
import subprocess
import sys
from typing import Any

import jax
import numpy as np

import tpurl
from tpurl.logging.writers import atomic_write_json

MANIFEST_FILE = "manifest.json"
MANIFEST_KEYS = ("tpurl_version", "git_commit", "git_dirty", "versions", "backend", "devices", "process_count",
                 "model_config", "param_count", "param_checksum", "task", "gin_config", "seed", "argv", "created",
                 "python", "extra")
_LIBRARIES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "chex", "gin-config", "numpy")


def _git(*args: str) -> str | None:
    repo = os.path.dirname(os.path.dirname(os.path.abspath(tpurl.__file__)))
    try:
        out = subprocess.run(["git", "-C", repo, *args], capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def library_versions() -> dict[str, str | None]:
    versions = {}
    for name in _LIBRARIES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def param_checksum(params) -> tuple[int, str]:
    """(parameter count, sha256 over every leaf's bytes in tree order) of a params pytree.

    Leaves are fetched to host one at a time; the hash is independent of sharding."""
    h = hashlib.sha256()
    count = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        arr = np.asarray(jax.device_get(leaf))
        count += arr.size
        h.update(jax.tree_util.keystr(path).encode())
        h.update(str(arr.dtype).encode())
        h.update(np.ascontiguousarray(arr).tobytes())
    return count, h.hexdigest()


def build_manifest(*, model_config, params, task, seed: int, gin_config: str,
                   extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The manifest dict for a run (see module docstring)."""
    count, checksum = param_checksum(params)
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {
        "tpurl_version": tpurl.__version__,
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": None if status is None else bool(status),
        "versions": library_versions(),
        "python": platform.python_version(),
        "backend": jax.default_backend(),
        "devices": [{"id": d.id, "kind": d.device_kind, "platform": d.platform, "process": d.process_index}
                    for d in jax.devices()],
        "process_count": jax.process_count(),
        "model_config": dataclasses.asdict(model_config),
        "param_count": count,
        "param_checksum": checksum,
        "task": {"name": task.name, "version": task.version, "grader": getattr(task, "grader", task.name),
                 "reward_components": list(task.reward_components),
                 **(task.describe() if hasattr(task, "describe") else {})},
        "gin_config": gin_config,
        "seed": seed,
        "argv": list(sys.argv),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "extra": extra or {},
    }


def write_manifest(run_dir: str, manifest: dict[str, Any]) -> str:
    path = os.path.join(run_dir, MANIFEST_FILE)
    atomic_write_json(path, manifest)
    return path
