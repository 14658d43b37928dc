"""Entry points: every `tpurl` command and the gin registration of the library's configs.

This package sits above the library and nothing in the library imports it (docs/architecture.md).
`tpurl.commands.main.main` dispatches `tpurl COMMAND` to the module named in its `COMMANDS`.
"""
