"""`tpurl`: a thin dispatcher over the commands of this package (`COMMANDS`).

Each command module defines `main(argv) -> int | None`; an expected error is printed as one line
with status 2 (`tpurl.commands.common`). XLA:CPU's compile flags and host memory are set up before a
command starts JAX (`tpurl.startup`).
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback

from tpurl.commands.common import fail, run_command

# subcommand -> (module, one-line help). Each module defines `main(argv: list[str]) -> int | None`.
COMMANDS = {
    "train": ("tpurl.commands.train", "run RL post-training from gin files (the main job)"),
    "launch": ("tpurl.commands.launch", "run a tpurl command as N local processes of one multi-process run"),
    "generate": ("tpurl.commands.generate", "sample completions from a checkpoint or preset"),
    "serve": ("tpurl.commands.serve", "an OpenAI-compatible endpoint on the rollout engine (chat, completions)"),
    "layouts": ("tpurl.commands.layouts", "print parameter shardings and bytes per device for each layout"),
    "check-layouts": ("tpurl.commands.check_layouts",
                      "gradient parity of every layout preset on this machine's devices (JSON lines)"),
    "score": ("tpurl.commands.score", "load a Hugging Face checkpoint and score a prompt"),
    "grade-code": ("tpurl.commands.grade_code", "grade a solution file against a test file in the sandbox"),
    "report": ("tpurl.commands.report", "plots and a Markdown summary of runs, from their logs"),
    "plan": ("tpurl.commands.plan", "predict memory per device and steps/hour of a config on a hardware preset"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        width = max(map(len, COMMANDS)) + 1
        lines = [f"  {name:<{width}} {help_}" for name, (_, help_) in COMMANDS.items()]
        msg = "usage: tpurl COMMAND [options]\n\ncommands:\n" + "\n".join(lines)
        if argv and argv[0] not in ("-h", "--help"):
            print(f"tpurl: unknown command {argv[0]!r}; use one of {', '.join(COMMANDS)} (see tpurl --help)",
                  file=sys.stderr)
            return 2
        print(msg)
        return 0
    from tpurl import startup

    try:
        startup.prepare()  # before anything starts JAX (see tpurl.startup)
    except ValueError as e:
        return fail(f"tpurl {argv[0]}", e)
    module = importlib.import_module(COMMANDS[argv[0]][0])
    try:
        status = run_command(f"tpurl {argv[0]}", module.main, argv[1:])
    except (SystemExit, KeyboardInterrupt) as e:
        if not _in_multiprocess_run():
            raise
        status = 130 if isinstance(e, KeyboardInterrupt) else e.code if isinstance(e.code, int) else 1
    except Exception:
        if not _in_multiprocess_run():
            raise
        traceback.print_exc()
        status = 1
    if _in_multiprocess_run():
        if status:
            _exit_now(status)
        from tpurl.sharding.distributed import leave

        leave(0)  # after the others finish too, without the teardown that can hang (see `leave`)
    return status


def _in_multiprocess_run() -> bool:
    jax = sys.modules.get("jax")  # never import JAX just to ask
    return jax is not None and jax.distributed.is_initialized()


def _exit_now(status: int) -> None:
    """Leave a failed multi-process run at once: a normal exit waits (minutes) at the shutdown
    barrier of `jax.distributed` for the processes that are still working; exiting lets the launcher
    see the failure and stop them."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    sys.exit(main())
