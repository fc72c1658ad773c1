"""The daemon's log: one JSON object a line on stderr, Optuna's records (a re-tune's studies) included."""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any


class JsonFormatter(logging.Formatter):
    _skip = frozenset(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}

    def format(self, record: logging.LogRecord) -> str:
        d: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for k, v in record.__dict__.items():
            if k not in self._skip:
                d[k] = v
        if record.exc_info:
            d["exc"] = self.formatException(record.exc_info)
        return json.dumps(d, default=str)


def setup_logging(level: str = "info") -> None:
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(JsonFormatter())
    root = logging.getLogger("moetune")
    root.handlers[:] = [h]
    root.setLevel(level.upper())
    root.propagate = False
    _optuna_into_json_log(h, level)


def _optuna_into_json_log(handler: logging.Handler, level: str) -> None:
    """A re-tune's Optuna studies log through the "optuna" logger, which Optuna gives its own plain-text stderr
    handler ("[I 2026-...] Trial 0 finished ..."): those lines broke the JSON log. Optuna's handler is removed and
    its records go through the daemon's JSON handler at the daemon's level (a trial's result is an info line)."""
    try:
        import optuna
    except ImportError:  # no tuner installed: nothing logs through Optuna
        return
    optuna.logging.disable_default_handler()  # also keeps Optuna from adding it back on a later call
    lg = logging.getLogger("optuna")
    lg.handlers[:] = [handler]
    lg.setLevel(level.upper())
    lg.propagate = False
