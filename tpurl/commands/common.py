"""What every command shares: argument parsing and one-line errors.

What a user can get wrong (a config, a file, a model folder, a tokenizer, a checkpoint, data)
raises one of `EXPECTED_ERRORS` with a message naming the thing and the fix; every command prints
it as one line, `tpurl COMMAND: message`, and exits with status 2, as it does for bad flags. Set
`TPURL_TRACEBACK=1` to get the traceback instead (when the message is not enough).
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

# ValueError covers config and data errors (and UnicodeDecodeError, JSONDecodeError); OSError
# missing or unreadable files; TypeError wrong types where a library checks them.
EXPECTED_ERRORS = (ValueError, TypeError, OSError)
TRACEBACK_ENV = "TPURL_TRACEBACK"


class ArgumentParser(argparse.ArgumentParser):
    """argparse, with a bad flag reported in one line (status 2) instead of usage + error."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def add_compile_cache_flag(parser: argparse.ArgumentParser) -> None:
    """`--compile-cache`: where the command keeps its compiled programs between runs."""
    parser.add_argument("--compile-cache", default="auto", metavar="DIR",
                        help="JAX's persistent compilation cache, so that a next run of the same programs "
                             "loads them instead of compiling: 'auto' (the default: JAX_COMPILATION_CACHE_DIR "
                             "if set, else ~/.cache/tpurl/jax, as tpurl train), a directory, or 'none' (off)")


def enable_compile_cache(value: str) -> None:
    """Turn the cache of `--compile-cache VALUE` on (or off), before the command's first compile; a
    value it cannot use is a one-line error naming the flag."""
    from tpurl.compile_cache import CompileCacheConfig, enable

    try:
        if not value.strip():
            raise ValueError("give a directory, 'auto' or 'none'")
        enable(CompileCacheConfig(dir=None if value == "none" else value))
    except ValueError as e:
        raise ValueError(f"--compile-cache {value!r}: {one_line(e)}") from None


def one_line(error: BaseException) -> str:
    """The first line of an error's message (gin and others append context lines)."""
    lines = str(error).strip().splitlines()
    return lines[0] if lines and lines[0].strip() else type(error).__name__


def fail(prog: str, error: BaseException, what: str = "") -> int:
    """Print `error` as one line, `prog: [what: ]message`, on stderr and return status 2; with
    `TPURL_TRACEBACK` set, raise it instead (call this inside the `except` block)."""
    from tpurl.files import os_no_space  # here: the commands' start-up imports nothing of the library

    if os.environ.get(TRACEBACK_ENV):
        raise error
    # The failed work may have left coroutines never awaited (orbax's writers, when a save runs out
    # of space): the warnings Python prints as they are collected, now or at exit, would add lines
    # of noise around the one that says why. (Process-wide: a failed command's process is ending.)
    warnings.filterwarnings("ignore", message=r"coroutine .* was never awaited", category=RuntimeWarning)
    kept = getattr(error, "traceback_file", None)  # a run kept the whole traceback there
    if os_no_space(error):
        # The OS's bare "No space left on device": say where, and what to do.
        where = f" at {error.filename}" if error.filename else ""
        error = OSError(f"no space left on device{where}; free space there and run again")
    # One write, newline included: another thread's log line (JAX's runtime) cannot land inside it.
    sys.stderr.write(f"{prog}: {what + ': ' if what else ''}{one_line(error)}"
                     f"{f' (traceback: {kept})' if kept else ''}\n")
    sys.stderr.flush()
    return 2


def run_command(prog: str, main, argv: list[str]) -> int:
    """`main(argv)`, with an expected error printed as one line `prog: message` (status 2), and so
    is running out of device memory (a model or batch too large for the devices)."""
    try:
        return int(main(argv) or 0)
    except EXPECTED_ERRORS as e:
        return fail(prog, e)
    except RuntimeError as e:
        if not out_of_device_memory(e) or os.environ.get(TRACEBACK_ENV):
            raise
        fix = OUT_OF_MEMORY_FIXES.get(prog, OUT_OF_MEMORY_FIXES[""])
        oom = MemoryError(f"out of device memory ({one_line(e)}); {fix}")
        oom.traceback_file = getattr(e, "traceback_file", None)
        return fail(prog, oom)


OUT_OF_MEMORY_FIXES = {
    "tpurl train": "`tpurl plan` with the same --gin_file/--gin_param flags shows what the run needs per device; "
                   "use a smaller model or batch, shorter sequences, ModelConfig.remat='full' or a layout that "
                   "shards more",
    "": "use a smaller model, fewer slots (--max-slots) or shorter prompts and completions",
}


def out_of_device_memory(error: BaseException) -> bool:
    """Whether `error` is XLA failing to allocate device memory (status RESOURCE_EXHAUSTED). Told by
    the class name, so that the dispatcher never imports JAX to ask."""
    return (type(error).__name__ in ("JaxRuntimeError", "XlaRuntimeError")
            and str(error).lstrip().startswith("RESOURCE_EXHAUSTED"))
