"""The errors of fabric discovery: input it could not make sense of, and a damaged capture directory."""

from __future__ import annotations

import os


class DiscoveryError(Exception):
    """Input discovery could not make sense of; `path` names the file (or command output)."""

    def __init__(self, path: str | os.PathLike[str], message: str) -> None:
        self.path = str(path)
        self.message = message
        super().__init__(f"{self.path}: {message}")


class CaptureError(DiscoveryError):
    """A capture directory holds a truncated, garbled or missing-but-required file."""
