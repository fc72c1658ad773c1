"""moetune's tuner side: discovery, fingerprint, fabric model, search, store, daemon and CLI."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("moetune")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0+unknown"
