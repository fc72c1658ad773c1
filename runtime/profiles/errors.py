"""The profile client's exceptions and warnings (`ProfileClient`, `TrackedProfile`, the fallback chain).

Their own module: the CLI, autoload and tests catch them without reaching into the client, and the daemon-info,
reply and tracking modules raise them without importing it.
"""

from __future__ import annotations

__all__ = [
    "BadReply",
    "DaemonError",
    "DaemonTimeout",
    "DaemonUnavailable",
    "EnvMismatchWarning",
    "FallbackWarning",
    "ProfileRefused",
]


class DaemonUnavailable(RuntimeError):
    """No reply from the daemon within the time budget (or no daemon socket at all)."""


class DaemonTimeout(DaemonUnavailable):
    """A request was sent and no reply came within the time budget: the daemon may still have acted on it."""


class BadReply(RuntimeError):
    """The daemon's reply does not validate: not JSON, wrong types, another protocol version, unknown fields."""


class ProfileRefused(RuntimeError):
    """The daemon's profile answers the request but may not be applied here (measured on another node or with this
    node's identity unknown, modelled without allow_modelled, its transport missing, env_mismatch = refuse)."""


class DaemonError(RuntimeError):
    """The daemon answered ok=false."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class FallbackWarning(RuntimeWarning):
    """The runtime could not get a tuned profile from the daemon and fell back."""


class EnvMismatchWarning(RuntimeWarning):
    """The tuned profile in use was measured in another NCCL/NVSHMEM/FI environment than this job's."""
