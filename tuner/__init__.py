"""moetune's tuner side: discovery, fingerprint, fabric model, search, store, daemon and CLI."""

def __getattr__(name: str) -> str:  # only `__version__`: any other name raises
    # `__version__` read on first use: importing importlib.metadata (zipfile, email, ...) here put ~40 ms of imports
    # in front of the CLI's Ctrl-C handling (`moetune.tuner.cli.main`), where a Ctrl-C printed a traceback
    if name == "__version__":
        from importlib.metadata import PackageNotFoundError, version

        try:
            value = version("moetune")
        except PackageNotFoundError:  # running from a source tree that was not installed
            value = "0+unknown"
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
