"""The driver of an RL run: setup, warm start, the step loop, evaluation, checkpoints, export.

`run(cfg, resume=..., gin_config=...)`:

1. resolve the run against the devices and the task (`tpurl.rl.spec`: one-line errors, before
   any work), and
   choose the run directory (never another run's: `tpurl.logging.run_dir`);
2. build the runtime (meshes, the rollout side, jitted steps); with `resume`, restore the newest
   checkpoint that restores (into an abstract template: nothing is loaded or built first), else
   initialize (from scratch or a Hugging Face checkpoint), run the SFT warm start and evaluate the
   warm-started policy on the held-out split;
3. write the manifest;
4. run the RL steps: log metrics and sampled trajectories, evaluate every `eval.every_steps`,
   checkpoint every `checkpoint.every_steps` (params, optimizer state, step, data cursor,
   reference policy; the per-step RNG is derived from the seed and the step);
5. evaluate the final policy, export it as Hugging Face safetensors, write `summary.json`.

An error once the RL steps are under way leaves its traceback in `traceback.txt` in the run
directory before it propagates (the command line prints it in one line, naming that file).

Multi-process runs (`jax.distributed`, `tpurl launch`): every process runs this same loop over the
global meshes, and every collective (checkpoint save and restore, host reads, the manifest's
parameter checksum, the export) is reached by all of them in the same order. Process 0 alone
chooses and claims the run directory (the others learn it from process 0) and writes the logs,
manifest, traceback, summary and export; the other processes write nothing there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import os
import sys
import time
import traceback
from typing import Any, Iterator

import jax

from tpurl.checkpoint import Checkpointer
from tpurl.files import os_no_space
from tpurl.logging import (MetricsLogger, TrajectoryLogger, atomic_write_json, atomic_write_text, build_manifest,
                           read_jsonl, write_manifest)
from tpurl.logging.metrics import METRICS_FILE, SUMMARY_FILE
from tpurl.logging.progress import Progress
from tpurl.logging.run_dir import CHECKPOINT_DIR, RunLock, checkpoint_steps, open_run_dir
from tpurl.memory import freeze_heap
from tpurl.rl.async_step import AsyncSteps
from tpurl.rl.compile_ahead import CompileAhead
from tpurl.rl.config import RLConfig
from tpurl.rl.evaluation import evaluate
from tpurl.rl.resume import check_allowed_fields, check_resume_config, config_record
from tpurl.rl.run_state import export_policy, fresh_state, restore_state, save_state
from tpurl.rl.runtime import RLRuntime
from tpurl.rl.spec import RunSpec, TaskLengths, resolve_run, task_config_for
from tpurl.rl.step import LoopState, rl_step, step_seed
from tpurl.rl.timeline import COMPILE_CLOCK, compile_seconds, compile_since, compile_summary, steady_steps, summarize
from tpurl.sharding.host import is_writer, on_writer
from tpurl.tasks import Task, make_task, user_code
from tpurl.train.state import state_sizes

TRACEBACK_FILE = "traceback.txt"  # written when the run stops on an error


class Interrupted(KeyboardInterrupt):
    """The run was interrupted (Ctrl-C); the message says at which step and how to continue."""


@dataclasses.dataclass
class RunResult:
    """What `run` returns (and writes to `summary.json`). `timeline`: mean seconds and share per
    phase over the steps that compiled no program (`steady_steps`); `compile`: how many steps
    compiled programs and the seconds they spent on it (`steps`, `seconds`), and the whole run's
    (`run_seconds`, every thread, warm start and evaluation included) with the `programs` it made and how
    many of them were `programs_loaded` from the persistent cache (`tpurl.compile_cache`), and the
    `ahead_programs` compiled on a background thread and its `ahead_seconds` (0 unless
    `RLConfig.compile_ahead`: `tpurl.rl.compile_ahead`); `checkpoints`: how many this run saved
    and the seconds they took (checksums included)."""

    run_dir: str
    steps: int
    warm_start_eval: dict[str, float]
    final_eval: dict[str, float]
    timeline: dict[str, dict[str, float]]
    compile: dict[str, float]
    export_dir: str | None
    resumed_from: int | None
    wall_s: float
    checkpoints: dict[str, float] = dataclasses.field(default_factory=dict)


def prepare(cfg: RLConfig, num_devices: int | None = None) -> tuple[RunSpec, Task]:
    """Build `cfg`'s task and resolve the run (`tpurl.rl.spec.resolve_run`), once per run: the
    spec and the task a runtime is built from. A bad config is a one-line ValueError."""
    _refuse_across_processes(cfg)
    task = make_task(task_config_for(cfg))
    return resolve_run(cfg, TaskLengths.of(task), num_devices or len(jax.devices())), task


def _check_pools_across_processes(placement) -> None:
    """The disaggregated pools a multi-process run can use, or one line saying what to change."""
    if placement.device_split != "per_process":
        raise ValueError(f"PlacementConfig.device_split={placement.device_split!r}: a multi-process run needs both "
                         "pools on every process (a process without train devices could not save its part of the "
                         "train state, nor read the other pool's results); use device_split='per_process'")
    n_train, n_rollout = placement.split(jax.device_count())
    if n_train != n_rollout or n_train % jax.process_count():
        raise ValueError(f"PlacementConfig.train_devices={placement.train_devices}, rollout_devices="
                         f"{placement.rollout_devices} ({n_train} + {n_rollout} devices): a multi-process "
                         "disaggregated run needs equal pools (its weight sync is a collective permute, device to "
                         f"device) that split evenly over the {jax.process_count()} processes; set both so")


def _refuse_across_processes(cfg: RLConfig) -> None:
    """What a multi-process run does not support, one line each (every process must make the same
    decisions and issue the same programs); nothing in a single-process run. Environments and
    graders need no refusal: process 0 runs them and sends every process its results."""
    if jax.process_count() == 1:
        return
    if cfg.async_rollout.enabled and cfg.async_rollout.overlap != "dispatch":
        raise ValueError(f"AsyncConfig.overlap={cfg.async_rollout.overlap!r}: across processes the rollout cannot "
                         "run on a thread of its own (two threads issuing cross-process collectives at once "
                         "deadlock); use overlap='dispatch'")
    if cfg.placement.mode == "disaggregated":
        _check_pools_across_processes(cfg.placement)
    if cfg.engine.kv_memory_fraction is not None:
        # Each process would read its own device's free memory and size a different KV pool.
        raise ValueError("EngineConfig.kv_memory_fraction cannot size the KV pool of a multi-process run (free "
                         "memory differs between processes); set EngineConfig.num_pages or kv_memory_bytes")


def _evaluate(rt: RLRuntime, state: LoopState) -> tuple[LoopState, dict[str, float]]:
    """Held-out evaluation of the current rollout weights, in a rollout window (colocated: the
    optimizer state waits in host memory while the KV pool is alive)."""
    seed = step_seed(rt.cfg.seed, state.step, salt=1)
    metrics, train, ref = rt.rollout.lend(lambda: evaluate(rt.rollout, rt.cfg.eval, seed=seed), state.train,
                                          state.ref_params)
    return dataclasses.replace(state, train=train, ref_params=ref), metrics


def _manifest(rt: RLRuntime, state: LoopState, gin_config: str, resumed_from: int | None) -> dict[str, Any]:
    cfg = rt.cfg
    return build_manifest(
        model_config=rt.model_cfg, params=state.train.model_state(), task=rt.task, seed=cfg.seed, gin_config=gin_config,
        code=user_code(rt.spec.task),
        extra={"resumed_from": resumed_from, "placement": cfg.placement.mode, "algorithm": cfg.algorithm.name,
               "loss_norm_len": cfg.algorithm.loss_norm_len,
               "max_staleness": cfg.async_rollout.max_staleness,
               "train_layout": cfg.train_layout.name, "rollout_layout": cfg.rollout_layout.name,
               "train_mesh": dict(rt.train_mesh.shape), "rollout_mesh": dict(rt.rollout_mesh.shape),
               "init_from": cfg.init_from, "tokenizer": rt.spec.task.tokenizer or "built-in",
               "train_state": state_sizes(state.train), "adapters": rt.spec.adapters})


class _Discard:
    """The logs of a process that does not write (every process but 0 of a multi-process run)."""

    def __getattr__(self, name: str):
        return lambda *args, **kwargs: None


class _Run:
    """The open files of one run: its directory (never another run's, `open_run_dir`), checkpoints
    and logs. The logs open once the step the run continues from is known (`open_logs`). Only
    process 0 claims the directory, writes logs and speaks; checkpoints are collective."""

    def __init__(self, cfg: RLConfig, resume: bool, or_start: bool, verbose: bool,
                 allow_changed: tuple[str, ...] = ()):
        self.cfg, self.verbose, self.writes = cfg, verbose and is_writer(), is_writer()
        self.allow_changed = allow_changed  # the config fields a resume may change (`tpurl.rl.resume`)
        self.lock: RunLock | None = None  # process 0's, held until `close`
        chosen = on_writer(lambda: self._open_dir(resume, or_start))
        self.dir, self.resume = chosen["dir"], chosen["resume"]
        try:
            self.ck = Checkpointer(os.path.join(self.dir, CHECKPOINT_DIR), max_to_keep=cfg.checkpoint.max_to_keep)
        except BaseException:
            self._release()
            raise
        self.resumed_from: int | None = None
        self.logger = self.trajectories = None  # until `open_logs`
        self.saves = {"saved": 0, "seconds": 0.0}
        self.ahead: dict[str, float] = {}  # what the steps compiled ahead (`CompileAhead.summary`)
        self.at_step: int | None = None  # the last RL step done (None: before the steps started)

    def _open_dir(self, resume: bool, or_start: bool) -> dict[str, Any]:
        """Choose and lock the run directory (process 0); keeps the lock, returns what the others learn."""
        directory, resumes, self.lock = open_run_dir(self.cfg.logging.run_dir, resume=resume, or_start=or_start)
        return {"dir": directory, "resume": resumes}

    def check_config(self, meta: dict[str, Any], step: int) -> None:
        """Refuse to resume checkpoint `step` (its `meta`) under another config (`tpurl.rl.resume`).
        The config as given is compared, as it was recorded: not the resolved one."""
        check_resume_config(meta.get("config"), config_record(self.cfg), step=step, allowed=self.allow_changed,
                            say=self.warn)

    def open_logs(self) -> None:
        """Open the logs (a resumed run's are cut back to the step it continues from)."""
        cfg = self.cfg
        if not self.writes:
            self.logger = self.trajectories = _Discard()
            return
        self.logger = MetricsLogger(self.dir, cfg.logging, run_config=dataclasses.asdict(cfg),
                                    resume_from_step=self.resumed_from, warn=self.warn)
        self.trajectories = TrajectoryLogger(self.dir, cfg.logging.trajectory_sample_rate)

    def say(self, msg: str) -> None:
        if self.verbose:
            self.warn(msg)

    def warn(self, msg: str) -> None:
        """Printed even when the run is quiet (by process 0)."""
        if self.writes:
            print(f"[tpurl] {msg}", file=sys.stderr, flush=True)

    def checkpoint(self, state: LoopState, warm_eval: dict[str, float], every: int | None = None) -> None:
        """Save `state` when periodic checkpoints are on (and, with `every`, at its multiples)."""
        n = self.cfg.checkpoint.every_steps
        if n and (every is None or state.step % n == 0):
            start = time.perf_counter()
            save_state(self.ck, state, {"warm_start_eval": warm_eval, "config": config_record(self.cfg)})
            self.saves["saved"] += 1
            self.saves["seconds"] += time.perf_counter() - start

    def close(self) -> None:
        """Close the logs (those opened) and the checkpointer, and release the run directory; the
        run ends here on every path."""
        try:
            for log in (self.logger, self.trajectories):
                if log is not None:
                    log.close()
        finally:
            try:
                self.ck.close()
            finally:
                self._release()

    def _release(self) -> None:
        if self.lock is not None:
            self.lock.release()


def _start(rt: RLRuntime, run: _Run) -> tuple[LoopState, dict[str, float]]:
    """The state the RL steps start from, and the warm-started policy's held-out evaluation:
    restored from the latest checkpoint, or initialized, warm-started and evaluated."""
    if run.resume:
        latest = run.ck.latest_step()
        newest = run.ck.meta(latest)  # the config is checked before anything is read or moved
        if newest is not None:
            run.check_config(newest, latest)
        run.resumed_from, state, meta = restore_state(rt, run.ck, run.warn)
        if run.resumed_from != latest:  # the newest did not restore: the one that did must match too
            run.check_config(meta, run.resumed_from)
        run.open_logs()
        run.say(f"resumed from checkpoint step {run.resumed_from} (cursor {state.cursor})")
        return state, meta.get("warm_start_eval", {})
    run.open_logs()
    state, sft_metrics = fresh_state(rt, rt.cfg, run.say, on_sft_step=run.logger.log_sft)
    state, warm_eval = _evaluate(rt, state)
    run.logger.log_eval(0, {**warm_eval, **sft_metrics})
    k = rt.cfg.eval.pass_k
    run.say(f"held-out accuracy after warm start: {warm_eval['eval/greedy_accuracy']:.1%} "
            f"(pass@{k}: {warm_eval.get(f'eval/pass@{k}', float('nan')):.1%})")
    run.checkpoint(state, warm_eval)
    return state, warm_eval


def _train(rt: RLRuntime, run: _Run, state: LoopState, warm_eval: dict[str, float]
           ) -> tuple[LoopState, dict[str, float]]:
    """The RL steps up to `cfg.steps`: logs, periodic evaluation and checkpoints. Returns the last
    state and its most recent evaluation ({} if none since the warm start)."""
    cfg = rt.cfg
    run.at_step = state.step
    progress = Progress(cfg.steps, initial=state.step, enabled=cfg.logging.progress_bar and run.verbose)
    last_eval = warm_eval if state.step == 0 else {}
    freeze_heap()
    warned = owed = False
    with _compile_ahead(rt, run) as ahead, _steps(rt) as step_fn:
        while state.step < cfg.steps:
            state, metrics, records, _ = step_fn(state)
            run.at_step = state.step
            owed = freeze_if_compiled(metrics, ahead, owed)
            if state.step < cfg.steps:
                ahead.schedule()
            run.logger.log_step(state.step, metrics)
            # Each record carries the version that sampled it; this one is the synchronous loop's.
            run.trajectories.log(state.step, state.policy_version - 1, records)
            warned = warned or _warn_env_errors(run, state.step, metrics, records)
            if cfg.eval.every_steps and state.step % cfg.eval.every_steps == 0 and state.step < cfg.steps:
                state, last_eval = _evaluate(rt, state)
                run.logger.log_eval(state.step, last_eval)
                metrics = {**metrics, **last_eval}
            run.checkpoint(state, warm_eval, every=cfg.checkpoint.every_steps)
            progress.update(metrics)
    progress.close()
    return state, last_eval


def freeze_if_compiled(metrics: dict[str, float], ahead: CompileAhead | None = None, owed: bool = False) -> bool:
    """After a step that compiled programs (the first; later, a new packed shape), on any thread
    (`compile/seconds`, `compile/rollout_seconds`), or after the compile-ahead thread's jobs,
    freeze them too (`freeze_heap`), or every later phase's memory account scans their tens of
    thousands of objects (cost: docs/performance.md). Not while that thread is making a program
    (its half-made objects would be kept for good): returns whether a freeze is then still `owed`."""
    owed = owed or compile_seconds(metrics) > 0
    done = 0 if ahead is None else ahead.settled()
    if done is None:
        return owed
    if owed or done:
        freeze_heap()
    return False


@contextlib.contextmanager
def _compile_ahead(rt: RLRuntime, run: _Run):
    """The run's `CompileAhead` (compiling only with `RLConfig.compile_ahead`), closed when the
    steps end; its counts go to `run.ahead`."""
    ahead = CompileAhead(rt.packed_programs() if rt.cfg.compile_ahead else [], warn=run.warn)
    try:
        yield ahead
    finally:
        ahead.close()
        run.ahead = ahead.summary()


@contextlib.contextmanager
def _steps(rt: RLRuntime):
    """The run's step function: `rl_step`, or with asynchronous rollout `AsyncSteps`, whose rollout
    thread is stopped and joined when the block ends (an error or interrupt included). Its segments
    drain at the evaluation and checkpoint steps, so there the rollout weights are the trainer's."""
    if not rt.cfg.async_rollout.enabled:
        yield functools.partial(rl_step, rt)
        return
    with AsyncSteps(rt) as steps:
        yield steps


def _warn_env_errors(run: _Run, step: int, metrics: dict[str, float], records: list[dict]) -> bool:
    """Say (once a run) that episodes failed in their tool, environment or grader, with an example;
    True once said. The run goes on: those samples get zero reward."""
    frac = metrics.get("rollout/env_error_frac", 0.0)
    if not frac:
        return False
    example = next((r["info"]["error"] for r in records if "error" in r.get("info", {})), None)
    run.warn(f"step {step}: {frac:.0%} of the episodes failed in their tool, environment or grader and got zero "
            f"reward{f' (e.g. {example})' if example else ''}; per step: rollout/env_error_frac in metrics.jsonl, "
            f"each error in its trajectory's info")
    return True


def _keep_traceback(run: _Run, error: Exception) -> None:
    """Keep the traceback of `error` (being handled) in the run directory, and its path on the
    error as `traceback_file`: the command line prints the error in one line, naming the file."""
    if not run.writes:
        return
    path = os.path.join(run.dir, TRACEBACK_FILE)
    try:
        atomic_write_text(path, traceback.format_exc())
    except OSError:  # a full disk (often the error itself): the error is what must reach the user
        return
    error.traceback_file = path


def _run_steps(rt: RLRuntime, run: _Run, state: LoopState, warm_eval: dict[str, float], gin_config: str
               ) -> tuple[LoopState, dict[str, float], str | None]:
    """The manifest, the RL steps, the final evaluation and the export; an error here leaves its
    traceback in the run directory. Returns the final state, its evaluation and the export's path."""
    if not rt.cfg.checkpoint.every_steps:
        run.warn("checkpoints are off (CheckpointConfig.every_steps=0): this run cannot be resumed if it stops")
    try:
        manifest = _manifest(rt, state, gin_config, run.resumed_from)  # collective: every process builds it
        if run.writes:
            write_manifest(run.dir, manifest, run.resumed_from)
            run.logger.log_config("manifest", manifest)
        state, final_eval = _train(rt, run, state, warm_eval)
        if state.step > 0 or not final_eval:
            state, final_eval = _evaluate(rt, state)
            run.logger.log_eval(state.step, final_eval)
        return state, final_eval, export_policy(rt, state, run.dir)
    except Exception as e:
        _keep_traceback(run, e)
        raise


def run(cfg: RLConfig, *, resume: bool = False, or_start: bool = False, allow_changed: tuple[str, ...] = (),
        gin_config: str = "", devices=None, verbose: bool = True,
        prepared: tuple[RunSpec, Task] | None = None) -> RunResult:
    """Run (or continue, with `resume`) the RL job described by `cfg`; see the module docstring.
    Where it writes: `tpurl.logging.run_dir.open_run_dir` (a fresh directory when the configured
    one holds another run; `or_start`: a new run when `resume` finds no checkpoint; a directory
    another process is running in is refused). A resumed run's config must be its checkpoint's,
    but for the fields `allow_changed` names (`tpurl.rl.resume`). `prepared`: what `prepare(cfg)`
    returned (prepared here when not given)."""
    start, compiled = time.perf_counter(), COMPILE_CLOCK.process_totals()
    spec, task = prepared or prepare(cfg, len(devices) if devices is not None else None)
    if resume:
        check_allowed_fields(allow_changed, config_record(cfg))
    # The runtime first: a config it rejects (a layout that does not divide, ...) leaves no directory.
    rt = RLRuntime(spec, task, devices=devices)
    run_ = _Run(cfg, resume, or_start, verbose, allow_changed)  # the directory is locked from here until `close`
    with no_space_named(run_.dir if run_.writes else None):
        return _run_in(rt, run_, start, compiled, gin_config)


NEARLY_FULL_BYTES = 64 << 20  # free space below which a bare "No space left" is the run directory's


@contextlib.contextmanager
def no_space_named(run_dir: str | None) -> Iterator[None]:
    """The OS's bare "No space left on device" (from a write that names no file: a tracker's, a
    summary's) as one line naming the run directory and how to continue, when that directory's
    device is the full one; an error that already says where (a checkpoint's, a log's own) passes
    unchanged. `run_dir`: None on a process that writes nothing."""
    try:
        yield
    except OSError as e:
        if run_dir is None or not os_no_space(e) or e.filename is not None or _free_bytes(run_dir) >= NEARLY_FULL_BYTES:
            raise
        steps = checkpoint_steps(run_dir)
        how = (f"then continue the run with --resume (from checkpoint step {steps[-1]})" if steps else
               "and run it again (it wrote no checkpoint)")
        full = OSError(f"no space left on the device of {run_dir}: the run could not write its files; free space "
                       f"there, {how}")
        full.errno = errno.ENOSPC
        full.traceback_file = getattr(e, "traceback_file", None)
        raise full from e


def _free_bytes(path: str) -> int:
    try:
        st = os.statvfs(path)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def _run_in(rt: RLRuntime, run_: _Run, start: float, compiled: dict, gin_config: str) -> RunResult:
    """`run`'s part once the run directory is open: the steps and the summary."""
    try:  # the logs, checkpointer and lock are let go however the run ends
        state, warm_eval = _start(rt, run_)  # a checkpoint or log that does not fit: one line, nothing written
        state, final_eval, export_dir = _run_steps(rt, run_, state, warm_eval, gin_config)
        records = [r for r in read_jsonl(os.path.join(run_.dir, METRICS_FILE)) if "time/step_s" in r] if run_.writes else []
        timeline = summarize(steady_steps(records))
        result = RunResult(run_dir=run_.dir, steps=state.step, warm_start_eval=warm_eval, final_eval=final_eval,
                           timeline=timeline, compile={**compile_summary(records), **compile_since(compiled), **run_.ahead},
                           export_dir=export_dir,
                           resumed_from=run_.resumed_from, wall_s=time.perf_counter() - start,
                           checkpoints=run_.saves)
        if run_.writes:
            atomic_write_json(os.path.join(run_.dir, SUMMARY_FILE), dataclasses.asdict(result))
            run_.logger.log_summary(dataclasses.asdict(result))  # the trackers close with it, below
    except KeyboardInterrupt:
        raise Interrupted(_interrupted(run_)) from None
    finally:
        run_.close()
    return result


def _interrupted(run: _Run) -> str:
    """Where an interrupted run stopped and how to continue it, in one line."""
    where = "before its first RL step" if run.at_step is None else f"after RL step {run.at_step} of {run.cfg.steps}"
    latest = run.ck.latest_step()
    if latest is None:
        how = ("no checkpoint was written yet, so it cannot be resumed" if run.cfg.checkpoint.every_steps else
               "checkpoints are off (CheckpointConfig.every_steps=0), so it cannot be resumed")
    else:
        how = f"continue it with --resume (from checkpoint step {latest}, in {run.dir})"
    return f"interrupted {where}; {how}"


def compile_line(c: dict[str, float]) -> str:
    """The report's line on making programs (`RunResult.compile`)."""
    where = jax.config.jax_compilation_cache_dir if jax.config.jax_enable_compilation_cache else None
    cache = f"the compile cache in {where}" if where else "the compile cache (off)"
    ahead = (f" ({c['ahead_programs']} of them compiled ahead on a background thread, {c['ahead_seconds']:.1f} s)"
             if c.get("ahead_programs") else "")
    return (f"compiling: {c['run_seconds']:.1f} s in the run; {c['programs'] - c['programs_loaded']} programs compiled"
            f"{ahead}, {c['programs_loaded']} loaded from {cache}")


def report(result: RunResult, pass_k: int) -> str:
    """The human-readable end-of-run report the CLI prints."""
    w, f = result.warm_start_eval, result.final_eval
    lines = ["", "=" * 72, f"tpurl run finished: {result.steps} RL steps in {result.wall_s / 60:.1f} min"
                            + (f" (resumed from step {result.resumed_from})" if result.resumed_from is not None else "")]
    if w and f:
        acc_w, acc_f = w["eval/greedy_accuracy"], f["eval/greedy_accuracy"]
        lines.append(f"held-out greedy accuracy: after warm start {acc_w:.1%}  ->  after RL {acc_f:.1%}  "
                     f"({100 * (acc_f - acc_w):+.1f} points)")
        key = f"eval/pass@{pass_k}"
        if key in w and key in f:
            lines.append(f"held-out pass@{pass_k}:          after warm start {w[key]:.1%}  ->  after RL {f[key]:.1%}")
        key = "eval/greedy_tool_calls"
        if key in w and key in f:
            lines.append(f"held-out tool calls per problem (greedy): after warm start {w[key]:.2f}  ->  after RL "
                         f"{f[key]:.2f}")
    if result.timeline:
        step = result.timeline.get("step", {}).get("mean_s", 0.0)
        lines.append(f"timeline (mean per step, {step:.3f} s):")
        for name, v in result.timeline.items():
            if name not in ("step",):
                lines.append(f"  {name:<12} {v['mean_s']:8.4f} s  {100 * v['share']:5.1f}%")
    lines.append(compile_line(result.compile))
    saves = result.checkpoints
    if saves.get("saved"):
        share = saves["seconds"] / max(result.wall_s, 1e-9)
        lines.append(f"checkpoints: {saves['saved']} saved in {saves['seconds']:.1f} s ({share:.1%} of the run), "
                     f"in {result.run_dir}/checkpoints/")
    lines.append(f"logs: {result.run_dir}/  (metrics.jsonl, eval.jsonl, trajectories.jsonl, manifest.json, "
                 f"summary.json, tb/ for TensorBoard when enabled)")
    if result.export_dir:
        lines.append(f"exported model (Hugging Face safetensors): {result.export_dir}")
    lines.append("=" * 72)
    return "\n".join(lines)
