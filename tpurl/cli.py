"""`tpurl` command line: a thin dispatcher; each subcommand lives with the concept it drives.

Errors: what a user can get wrong (a config, a file, a model folder, a tokenizer, a checkpoint,
data) raises one of `EXPECTED_ERRORS` with a message naming the thing and the fix; every
subcommand prints it as one line, `tpurl COMMAND: message`, and exits with status 2, as it does for
bad flags. Set `TPURL_TRACEBACK=1` to get the traceback instead (when the message is not enough).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback

# subcommand -> (module, one-line help). Each module defines `main(argv: list[str]) -> int | None`.
COMMANDS = {
    "train": ("tpurl.rl.cli", "run RL post-training from gin files (the main job)"),
    "launch": ("tpurl.launch", "run a tpurl command as N local processes of one multi-process run"),
    "generate": ("tpurl.generate.cli", "sample completions from a checkpoint or preset"),
    "layouts": ("tpurl.sharding.cli", "print parameter shardings and bytes per device for each layout"),
    "score": ("tpurl.models.cli", "load a Hugging Face checkpoint and score a prompt"),
    "grade-code": ("tpurl.sandbox.cli", "grade a solution file against a test file in the sandbox"),
    "report": ("tpurl.report.cli", "plots and a Markdown summary of runs, from their logs"),
    "plan": ("tpurl.plan.cli", "predict memory per device and steps/hour of a config on a hardware preset"),
}

# ValueError covers config and data errors (and UnicodeDecodeError, JSONDecodeError); OSError
# missing or unreadable files; TypeError wrong types where a library checks them.
EXPECTED_ERRORS = (ValueError, TypeError, OSError)
TRACEBACK_ENV = "TPURL_TRACEBACK"


class ArgumentParser(argparse.ArgumentParser):
    """argparse, with a bad flag reported in one line (status 2) instead of usage + error."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def one_line(error: BaseException) -> str:
    """The first line of an error's message (gin and others append context lines)."""
    lines = str(error).strip().splitlines()
    return lines[0] if lines and lines[0].strip() else type(error).__name__


def fail(prog: str, error: BaseException, what: str = "") -> int:
    """Print `error` as one line, `prog: [what: ]message`, on stderr and return status 2; with
    `TPURL_TRACEBACK` set, raise it instead (call this inside the `except` block)."""
    if os.environ.get(TRACEBACK_ENV):
        raise error
    kept = getattr(error, "traceback_file", None)  # a run kept the whole traceback there
    # One write, newline included: another thread's log line (JAX's runtime) cannot land inside it.
    sys.stderr.write(f"{prog}: {what + ': ' if what else ''}{one_line(error)}"
                     f"{f' (traceback: {kept})' if kept else ''}\n")
    sys.stderr.flush()
    return 2


def run_command(prog: str, main, argv: list[str]) -> int:
    """`main(argv)`, with an expected error printed as one line `prog: message` (status 2)."""
    try:
        return int(main(argv) or 0)
    except EXPECTED_ERRORS as e:
        return fail(prog, e)


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
    from tpurl import hostmem

    try:
        hostmem.keep_freed_memory()  # before anything starts JAX (see tpurl.hostmem)
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
