"""ScenarioError: a scenario that cannot be read or run here."""

from __future__ import annotations


class ScenarioError(ValueError):
    """A scenario that cannot be read or run here; the message names the file, key or missing resource."""
