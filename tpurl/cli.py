"""`tpurl` command line: a thin dispatcher; each subcommand lives with the concept it drives."""

from __future__ import annotations

import importlib
import sys

# subcommand -> (module, one-line help). Each module defines `main(argv: list[str]) -> int | None`.
COMMANDS = {
    "train": ("tpurl.rl.cli", "run RL post-training from gin files (the main job)"),
    "generate": ("tpurl.generate.cli", "sample completions from a checkpoint or preset"),
    "layouts": ("tpurl.sharding.cli", "print parameter shardings and bytes per device for each layout"),
    "score": ("tpurl.models.cli", "load a Hugging Face checkpoint and score a prompt"),
    "grade-code": ("tpurl.sandbox.cli", "grade a solution file against a test file in the sandbox"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        width = max(map(len, COMMANDS)) + 1
        lines = [f"  {name:<{width}} {help_}" for name, (_, help_) in COMMANDS.items()]
        msg = "usage: tpurl COMMAND [options]\n\ncommands:\n" + "\n".join(lines)
        if argv and argv[0] not in ("-h", "--help"):
            print(f"tpurl: unknown command {argv[0]!r}\n\n{msg}", file=sys.stderr)
            return 2
        print(msg)
        return 0
    module = importlib.import_module(COMMANDS[argv[0]][0])
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
