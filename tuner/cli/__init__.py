"""The `moetune` command line: one Typer app (`_app`), one module per command group.

The console script's module is `_entry` (pyproject: `moetune = "moetune.tuner.cli._entry:main"`): Python's default
Ctrl-C raises KeyboardInterrupt wherever the interpreter is, and a Ctrl-C in the imports ahead of the CLI's own
handling printed a traceback from inside an import. `_entry` takes Ctrl-C over first, so every module on its way
(this one too, the package `__init__` the import of `_entry` runs first) stays free of imports: this one imports
nothing. `main` (`_main`: the CLI's Ctrl-C handling around the app), `app` and `EXIT_STATUS_HELP` (`_app`) are
re-exported lazily (`from moetune.tuner.cli import main, app`)."""

TYPE_CHECKING = False  # not `typing`'s: importing typing is one more import ahead of the entry point's handling
if TYPE_CHECKING:
    from typing import Any

    from moetune.tuner.cli._app import EXIT_STATUS_HELP, app
    from moetune.tuner.cli._main import main

__all__ = ["EXIT_STATUS_HELP", "app", "main"]

def __getattr__(name: str) -> "Any":
    if name == "main":
        from moetune.tuner.cli._main import main as value
    elif name in ("app", "EXIT_STATUS_HELP"):
        from moetune.tuner.cli import _app

        value = getattr(_app, name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # later lookups skip this function
    return value
