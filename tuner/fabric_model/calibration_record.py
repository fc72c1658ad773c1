"""What a preset's `[calibration]` records: a forced fit's warning, the world and tokens it measured."""

from __future__ import annotations

from collections.abc import Mapping


def forced_fit_warning(preset: object) -> str:
    """The `[calibration] warning` of a fit the calibration checks refused and `moetune model calibrate --force`
    wrote anyway ('' for an accepted calibration or a shipped preset)."""
    calib = getattr(preset, "calibration", None)
    warning = calib.get("warning") if isinstance(calib, Mapping) else None
    return str(warning) if warning else ""


def calibrated_world(preset: object) -> int | None:
    """The most ranks (GPUs, or gloo host processes) a row of the preset's calibration measured together
    (`[calibration] world`); None where the preset records no measured scale (a datasheet preset, a calibration of
    rows that state no world, a file written by an older moetune)."""
    calib = getattr(preset, "calibration", None)
    world = calib.get("world") if isinstance(calib, Mapping) else None
    return world if isinstance(world, int) and not isinstance(world, bool) and world >= 1 else None


def calibrated_tokens(preset: object) -> tuple[int, int] | None:
    """(least, most) tokens per GPU the rows of the preset's calibration measured (`[calibration] tokens`); None where
    the preset records no range (a datasheet preset, a calibration of rows that state no S, an older moetune's file)."""
    calib = getattr(preset, "calibration", None)
    tokens = calib.get("tokens") if isinstance(calib, Mapping) else None
    if (isinstance(tokens, list | tuple) and len(tokens) == 2
            and all(isinstance(t, int) and not isinstance(t, bool) and t >= 1 for t in tokens)):
        return int(tokens[0]), int(tokens[1])
    return None
