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
