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

Checkpoints are verified: once a save is complete, the sha256 of every file in it is written to
`<step>/tpurl-checksums.json`, and `restore_latest` checks them first. A checkpoint whose bytes
changed since (a flipped bit, a bad disk or copy, even one that keeps every file's size) is
damaged, handled as below. One without checksums (an older tpurl wrote it, or the run stopped
between orbax's atomic commit and the checksums) is restored unverified, and that is said.

In a multi-process run every process saves and restores together (orbax writes each process's
shards and process 0 the metadata; the saved arrays are global), and only process 0 moves a
damaged checkpoint aside.

Resuming (`restore_latest`) takes the newest checkpoint that restores: one whose files cannot be
read (a damaged disk, a partial copy) is moved aside to `<directory>.damaged/<step>`, reported with
the reason, and the next older one is tried. A checkpoint whose structure or shapes differ from
the run's is a config mismatch, not damage: that is an error at once (every checkpoint of the run
would differ alike).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import errno
import functools
import gc
import glob
import hashlib
import json
import logging
import os
import shutil
import sys
import threading
from typing import Any, Callable

import jax
import numpy as np
import orbax.checkpoint as ocp

from tpurl.config_types import check_types
from tpurl.files import atomic_write_json
from tpurl.sharding.host import all_processes, barrier, is_writer


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """A checkpoint every `every_steps` RL steps (and after the warm start), the newest
    `max_to_keep` kept; `every_steps=0` turns them off (the run says so before its first RL step: it
    cannot be resumed), the final state is still exported (`export_hf`)."""

    every_steps: int = 50
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


CHECKSUM_FILE = "tpurl-checksums.json"


class ChecksumError(ValueError):
    """A checkpoint's files are not the bytes that were saved."""


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def file_checksums(directory: str) -> dict[str, str]:
    """sha256 of every file under `directory` but `CHECKSUM_FILE`, by relative path (hashed in
    parallel: hashlib lets go of the GIL)."""
    paths = sorted(os.path.relpath(os.path.join(root, name), directory)
                   for root, _, names in os.walk(directory) for name in names if name != CHECKSUM_FILE)
    with concurrent.futures.ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
        digests = pool.map(lambda rel: _sha256(os.path.join(directory, rel)), paths)
        return dict(zip(paths, digests))


def verify_checksums(directory: str) -> bool:
    """Check every file under `directory` against the checksums `CHECKSUM_FILE` recorded: raise
    `ChecksumError` (one line) when a file changed, is missing or was added, or the checksums
    cannot be read; True when all match, False when there are none (an older tpurl wrote the
    checkpoint, or the run stopped between orbax's commit, which is atomic, and the checksums)."""
    try:
        with open(os.path.join(directory, CHECKSUM_FILE)) as f:
            want = json.load(f)["sha256"]
    except FileNotFoundError:
        return False
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ChecksumError(f"its checksums cannot be read ({type(e).__name__})") from None
    have = file_checksums(directory)
    bad = sorted(p for p in want.keys() | have.keys() if want.get(p) != have.get(p))
    if bad:
        what = ", ".join(f"{p} ({'missing' if p not in have else 'added' if p not in want else 'changed'})"
                         for p in bad[:3])
        raise ChecksumError(f"its files differ from what was saved: {what}{' ...' if len(bad) > 3 else ''}")
    return True


class CheckpointMismatchError(ValueError):
    """The checkpoint was written by a run with another structure or other shapes (another config)."""


def _first_line(error: BaseException) -> str:
    # TensorStore appends its whole spec ("See full TensorStore details: ..."): keep the sentence.
    lines = str(error).split(" See full TensorStore details")[0].strip().splitlines()
    return f"{type(error).__name__}: {lines[0][:200]}" if lines else type(error).__name__


def _orbax_echo(error: BaseException | None, where: str = "") -> bool:
    return (isinstance(error, RuntimeError) and "Event loop is closed" in str(error)) or "orbax" in where


@contextlib.contextmanager
def _quiet_orbax():
    """Orbax reads and writes arrays in concurrent coroutines and threads; when one fails (damaged
    data, a full disk), the others' errors surface as tracebacks of their own: "Exception ignored in
    <coroutine>", "Event loop is closed" from reader and writer threads, and absl ERROR lines from
    its signalling threads. The first error is reported in one line: drop these echoes while a
    checkpoint is saved or tried, and pass anything else on."""
    unraisable, excepthook, thread_hook = sys.unraisablehook, sys.excepthook, threading.excepthook
    # absl: orbax's signalling threads; asyncio: its failed tasks, "never retrieved" once collected.
    loggers = [logging.getLogger(name) for name in ("absl", "asyncio")]
    levels = [log.level for log in loggers]

    def quiet_unraisable(u):
        if not _orbax_echo(u.exc_value, getattr(getattr(u.object, "cr_code", None), "co_filename", "")):
            unraisable(u)

    def quiet_excepthook(kind, value, tb):
        if not _orbax_echo(value):
            excepthook(kind, value, tb)

    def quiet_thread_hook(args):
        if not _orbax_echo(args.exc_value):
            thread_hook(args)

    sys.unraisablehook, sys.excepthook, threading.excepthook = quiet_unraisable, quiet_excepthook, quiet_thread_hook
    for log in loggers:
        log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        gc.collect()
        sys.unraisablehook, sys.excepthook, threading.excepthook = unraisable, excepthook, thread_hook
        for log, level in zip(loggers, levels):
            log.setLevel(level)


@functools.cache
def _quiet_from_now_on():
    """`_quiet_orbax` entered once for the rest of the process (see `Checkpointer.save`); the cache
    keeps it: a context manager left to the garbage collector would restore the hooks."""
    quiet = _quiet_orbax()
    quiet.__enter__()
    return quiet


def _no_space(error: BaseException) -> bool:
    """Whether `error` (an OSError, or orbax/TensorStore's ValueError with the OS error in its
    text) is a full disk."""
    return (isinstance(error, OSError) and error.errno == errno.ENOSPC) or "No space left on device" in str(error)


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
        shapes = [list(np.shape(leaf)) for leaf in arrays.values()]
        step_dir = os.path.join(self.directory, str(step))
        try:
            with _quiet_orbax():
                self._manager.save(step, args=ocp.args.Composite(
                    arrays=ocp.args.StandardSave(arrays),
                    meta=ocp.args.JsonSave({"meta": meta, "paths": paths, "shapes": shapes})), force=True)
                self._manager.wait_until_finished()
            if is_writer():  # every process's files are complete here (orbax's commit is collective)
                atomic_write_json(os.path.join(step_dir, CHECKSUM_FILE), {"sha256": file_checksums(step_dir)})
        except Exception as e:
            if not _no_space(e):
                raise
            # Orbax's writers fail after the first error too, some of them later (as their tasks are
            # collected, at exit): the run ends on this error, so keep their echoes quiet from now on.
            _quiet_from_now_on()
            self._discard_partial(step)
            full = OSError(f"no space left on the device of {self.directory}: checkpoint step {step} was not saved "
                           "(the ones before it are kept); free space there, then continue the run with --resume")
            full.errno = errno.ENOSPC
            raise full from None
        barrier(f"tpurl.checkpoint.checksums {step_dir}")

    def _discard_partial(self, step: int) -> None:
        """Remove what a failed save of `step` left (orbax's temporary directory, or the step
        without its checksums), freeing its space; the checkpoints before it stay."""
        if is_writer():
            for path in glob.glob(os.path.join(glob.escape(self.directory), f"{step}.orbax-checkpoint-tmp*")) + \
                    [os.path.join(self.directory, str(step))]:
                shutil.rmtree(path, ignore_errors=True)
        self._manager.reload()

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
            raise CheckpointMismatchError(
                f"checkpoint {self.directory}/{step} has a different structure than the run "
                f"({len(saved['paths'])} vs {len(paths)} leaves; differing: {diff}); "
                "resume with the config the checkpoint was written with")
        for path, (key, want), have in zip(paths, abstract.items(), saved.get("shapes") or [None] * len(paths)):
            if have is not None and tuple(have) != tuple(want.shape):
                raise CheckpointMismatchError(
                    f"checkpoint {self.directory}/{step} does not fit the run: {path} has shape {tuple(have)} there "
                    f"but {tuple(want.shape)} here; resume with the config the checkpoint was written with")
        out = self._manager.restore(step, args=ocp.args.Composite(arrays=ocp.args.StandardRestore(abstract)))
        leaves = [out["arrays"][k] for k in sorted(out["arrays"])]
        treedef = jax.tree_util.tree_structure(like)
        return jax.tree_util.tree_unflatten(treedef, leaves), saved["meta"]

    def restore_latest(self, like, *, say: Callable[[str], None] | None = None) -> tuple[int, Any, dict[str, Any]]:
        """Restore the newest checkpoint that restores into `like` (see `restore`); returns
        `(step, tree, meta)`. A checkpoint that fails to read is skipped for the next older one;
        once an older one restores (so the failure was the newer one's, not this machine's: out of
        memory, a missing device, ...), the failed ones are moved to `<directory>.damaged/` and
        reported through `say` (default: printed to stderr) with the reason. When none restores,
        nothing is moved and a one-line ValueError lists why. Raises `CheckpointMismatchError`
        when the run's structure or shapes differ from a checkpoint's. In a multi-process run the
        processes agree: a checkpoint restores only when it restores on every process."""
        say = say or (lambda m: print(f"[tpurl] {m}", file=sys.stderr, flush=True))
        failed: list[tuple[int, str]] = []
        with _quiet_orbax():
            for step in sorted(self.all_steps(), reverse=True):
                tree, meta, why, verified = self._try_restore(step, like)
                if not all_processes(why is None):
                    failed.append((step, why or "another process could not restore it"))
                    del tree
                    continue
                for bad, why in failed:
                    say(f"checkpoint step {bad} does not restore ({why}); moved it to {self._move_aside(bad)}, "
                        f"resuming from step {step}")
                if not verified:
                    say(f"checkpoint step {step} has no checksums (an older tpurl wrote it, or the run stopped right "
                        "after saving it): restored without verifying its files")
                return step, tree, meta
        if not failed:
            raise ValueError(f"no checkpoint in {self.directory} to resume from; start a new run without --resume")
        raise ValueError(f"no checkpoint in {self.directory} restores ({'; '.join(f'{s} ({w})' for s, w in failed)}); "
                         "nothing was moved; start a new run without --resume, or fix what the reasons name")

    def _try_restore(self, step: int, like) -> tuple[Any, dict[str, Any] | None, str | None, bool]:
        """`(tree, meta, None, verified)`, or `(None, None, why, False)` when checkpoint `step` does
        not restore here. Process 0 verifies its checksums first and every process learns the
        verdict before any starts the (collective) restore."""
        why, verified = None, True
        if is_writer():
            try:
                verified = verify_checksums(os.path.join(self.directory, str(step)))
            except ChecksumError as e:
                why = _first_line(e)
        if not all_processes(why is None):
            return None, None, why or "process 0 found its files changed", False
        try:
            tree, meta = self.restore(step, like)
        except CheckpointMismatchError:
            raise
        except Exception as e:  # noqa: BLE001 (tensorstore raises bare Exceptions for unreadable data)
            return None, None, _first_line(e), False
        return tree, meta, None, verified

    def meta(self, step: int) -> dict[str, Any] | None:
        """The JSON metadata saved with checkpoint `step` (read without its arrays), or None when
        it cannot be read. Collective in a multi-process run, as `restore` is."""
        try:
            with _quiet_orbax():
                saved = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        except Exception:  # noqa: BLE001 -- a damaged checkpoint: `restore_latest` says why
            return None
        return saved.get("meta") if isinstance(saved, dict) else None

    def _move_aside(self, step: int) -> str:
        """Move checkpoint `step` out of the manager's directory (so the run can save that step
        again) into `<directory>.damaged/<step>[-n]`, kept for inspection; returns the new path."""
        target_dir = f"{self.directory}.damaged"
        target, n = os.path.join(target_dir, str(step)), 1
        while os.path.exists(target):
            n += 1
            target = os.path.join(target_dir, f"{step}-{n}")
        if is_writer():  # one process moves it; the others wait, then see it gone
            os.makedirs(target_dir, exist_ok=True)
            os.replace(os.path.join(self.directory, str(step)), target)
        barrier(f"tpurl.checkpoint.move_aside {self.directory}/{step}")
        self._manager.reload()
        return target

    def close(self) -> None:
        self._manager.close()


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def export_hf(model, directory: str, *, tokenizer_dir: str | None = None) -> str:
    """Write the policy as a Hugging Face checkpoint (config.json + safetensors) loadable by
    `transformers`, with the tokenizer files of `tokenizer_dir` (those of `TOKENIZER_FILES` that
    exist) next to it, so that the export is a complete model directory; returns the directory."""
    from tpurl.models.hf import save_hf_checkpoint

    save_hf_checkpoint(model, directory)  # collective in a multi-process run; process 0 writes
    for name in TOKENIZER_FILES if tokenizer_dir and is_writer() else ():
        src = os.path.join(tokenizer_dir, name)
        if os.path.exists(src):
            tmp = os.path.join(directory, f".{name}.tmp")
            shutil.copyfile(src, tmp)
            os.replace(tmp, os.path.join(directory, name))  # never a half-written file
    return directory
