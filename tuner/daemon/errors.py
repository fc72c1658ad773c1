"""The daemon's refusals, in a module of their own so that every daemon module (and the CLI) can raise and catch them
without importing the server."""

from __future__ import annotations


class DaemonConfigError(ValueError):
    """A refused configuration (TCP without CURVE, a runtime directory we do not own, ...)."""


class DaemonBusy(DaemonConfigError):
    """Another moetune daemon holds the database or listens on the socket: nothing is wrong with the configuration;
    it exits 1, as a StoreBusy (another process holds the database) does, not 2."""

    exit_code = 1

    def __init__(self, message: str, holder: str | None = None) -> None:
        super().__init__(message)
        # the lock's holder as the lock names it ("pid N" / "its pid unknown"), where a held lock refused it: a
        # clean-up that only keeps a file says who has it, without the start's advice to stop it
        self.holder = holder
