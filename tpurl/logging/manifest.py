"""The run manifest: everything needed to say what a run was, to reproduce it, and to know whether
two runs can be compared.

Fields (see `MANIFEST_KEYS`): tpurl version and git commit; the version of every library that
shapes results (`versions`: JAX and jaxlib, the accelerator plugin when there is one, flax, optax,
orbax, chex, numpy, ml_dtypes, tensorstore, tokenizers, safetensors, jinja2, gin) and the backend's
own version (`backend_version`, e.g. the CUDA or TPU runtime); backend and devices; the model
(`model`: a hash of its config, the checksum of the parameters the run started from or resumed, and
the checksums of the files of the checkpoint it was initialized from); the task, its grader and
their versions, the checksum of every data file (a saved dataset directory: of its files), and
the user's code the task runs (a task class or reward function named by import path: its file
and checksum, `task.code`); the tokenizer's checksum; the sandbox that
tools and graders run in (the task's `describe()["sandbox"]`: the isolation mechanisms and limits
in force, as `tpurl.sandbox.sandbox_mechanisms` reports them; `none` for a task whose grader runs
in the training process, e.g. exact-match arithmetic); the full
operative gin config, the seed, the command line and start time. Written atomically.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
from typing import Any

import jax
import numpy as np

import tpurl
from tpurl.files import atomic_write_json
from tpurl.sharding.host import to_host
from tpurl.tasks.base import sandbox_of

MANIFEST_FILE = "manifest.json"
MANIFEST_KEYS = ("tpurl_version", "git_commit", "git_dirty", "versions", "backend", "backend_version", "devices",
                 "process_count", "model_config", "model", "param_count", "param_checksum", "task", "tokenizer",
                 "sandbox", "gin_config", "seed", "argv", "created", "python", "extra")
_LIBRARIES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "chex", "gin-config", "numpy", "ml_dtypes",
              "tensorstore", "tokenizers", "safetensors", "jinja2")
# Accelerator plugins: recorded when installed (they compile and run every kernel).
_PLUGINS = ("jax-cuda12-plugin", "jax-cuda12-pjrt", "jax-cuda13-plugin", "jax-cuda13-pjrt", "libtpu",
            "libtpu-nightly", "jax-rocm-plugin")
# The `sandbox` of a task that runs no untrusted code: its grader runs in the training process.
# The files of a Hugging Face checkpoint that decide its model (hashed when a run starts from one).
_CHECKPOINT_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def _git(*args: str) -> str | None:
    repo = os.path.dirname(os.path.dirname(os.path.abspath(tpurl.__file__)))
    try:
        out = subprocess.run(["git", "-C", repo, *args], capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def library_versions() -> dict[str, str | None]:
    """Versions of `_LIBRARIES` (None when missing) and of the accelerator plugins installed."""
    versions = {}
    for name in _LIBRARIES + _PLUGINS:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            if name in _LIBRARIES:
                versions[name] = None
    return versions


def file_checksum(path: str) -> str:
    """sha256 of a file's bytes (read in chunks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def path_checksum(path: str) -> str:
    """sha256 of a file, or of a directory's files (each one's relative path and bytes, in
    sorted order: a saved dataset)."""
    if not os.path.isdir(path):
        return file_checksum(path)
    h = hashlib.sha256()
    for root, dirs, files in os.walk(path):
        dirs.sort()
        for name in sorted(files):
            full = os.path.join(root, name)
            h.update(os.path.relpath(full, path).encode() + b"\0" + file_checksum(full).encode())
    return h.hexdigest()


def _code(code: dict[str, str | None]) -> dict[str, dict[str, str | None]]:
    """The user's code by import path: its file and the file's checksum."""
    return {path: {"file": f, "sha256": file_checksum(f) if f and os.path.exists(f) else None}
            for path, f in code.items()}


def checkpoint_checksums(directory: str) -> dict[str, str]:
    """sha256 of each file of a Hugging Face checkpoint directory that decides the model: config,
    weights (safetensors and index) and tokenizer files."""
    names = sorted(n for n in os.listdir(directory)
                   if n in _CHECKPOINT_FILES or n.endswith(".safetensors") or n.endswith(".safetensors.index.json"))
    return {n: file_checksum(os.path.join(directory, n)) for n in names}


def config_hash(config) -> str:
    """sha256 of a config dataclass as canonical JSON (equal configs, equal hashes)."""
    text = json.dumps(dataclasses.asdict(config), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def param_checksum(params) -> tuple[int, str]:
    """(parameter count, sha256 over every leaf's bytes in tree order) of a params pytree.

    Leaves are fetched to host one at a time; the hash is independent of sharding. In a
    multi-process run every process must call this (leaves are gathered across processes)."""
    h = hashlib.sha256()
    count = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        arr = to_host(leaf)
        count += arr.size
        h.update(jax.tree_util.keystr(path).encode())
        h.update(str(arr.dtype).encode())
        h.update(np.ascontiguousarray(arr).tobytes())
    return count, h.hexdigest()


def _tokenizer(task) -> dict[str, Any]:
    tok = task.tokenizer
    checksum = tok.checksum() if hasattr(tok, "checksum") else None
    return {"kind": type(tok).__name__, "vocab_size": tok.vocab_size, "checksum": checksum}


def build_manifest(*, model_config, params, task, seed: int, gin_config: str,
                   extra: dict[str, Any] | None = None, code: dict[str, str | None] | None = None) -> dict[str, Any]:
    """The manifest dict for a run (see module docstring). `extra["init_from"]`, when set, is the
    Hugging Face checkpoint directory the run was initialized from: its files are hashed. `code`:
    the user's task class or reward function by import path, with its source file (hashed)."""
    count, checksum = param_checksum(params)
    status = _git("status", "--porcelain", "--untracked-files=no")
    init_from = (extra or {}).get("init_from")
    data_files = getattr(task, "data_files", ())
    described = dict(task.describe()) if hasattr(task, "describe") else {}
    described.pop("sandbox", None)
    sandbox = sandbox_of(task)
    return {
        "tpurl_version": tpurl.__version__,
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": None if status is None else bool(status),
        "versions": library_versions(),
        "python": platform.python_version(),
        "backend": jax.default_backend(),
        "backend_version": getattr(jax.devices()[0].client, "platform_version", None),
        "devices": [{"id": d.id, "kind": d.device_kind, "platform": d.platform, "process": d.process_index}
                    for d in jax.devices()],
        "process_count": jax.process_count(),
        "model_config": dataclasses.asdict(model_config),
        "model": {"config_hash": config_hash(model_config), "param_checksum": checksum,
                  "init_from": init_from, "init_from_checksums": checkpoint_checksums(init_from) if init_from else None},
        "param_count": count,
        "param_checksum": checksum,
        "task": {"name": task.name, "version": task.version, "grader": getattr(task, "grader", task.name),
                 "reward_components": list(task.reward_components),
                 "data_files": {path: path_checksum(path) for path in data_files},
                 "code": _code(code or {}),
                 **described},
        "tokenizer": _tokenizer(task),
        "sandbox": sandbox,
        "gin_config": gin_config,
        "seed": seed,
        "argv": list(sys.argv),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "extra": extra or {},
    }


def write_manifest(run_dir: str, manifest: dict[str, Any], resumed_from: int | None = None) -> str:
    """Write `manifest.json`; a resumed run keeps the original one (what first ran) and writes its
    own beside it, `manifest.resume-<step>.json`. Returns the path written."""
    path = os.path.join(run_dir, MANIFEST_FILE)
    if resumed_from is not None and os.path.exists(path):
        path = os.path.join(run_dir, f"manifest.resume-{resumed_from}.json")
    atomic_write_json(path, manifest)
    return path
