"""`moetune model sweep --out`: the plot of a sweep (latency and fences per fence mode), and where it is written."""

from __future__ import annotations

from pathlib import Path

from moetune.tuner.cli._args import write_error_code
from moetune.tuner.cli.db import abort
from moetune.tuner.cli.model_output import check_out_file

_fail = abort  # fail() escapes: a path or value in brackets is text, not Rich markup


def _plot_formats() -> dict[str, str]:
    """Image formats `--out` can write (by file suffix)."""
    from matplotlib.backend_bases import FigureCanvasBase

    formats = dict(FigureCanvasBase.get_supported_filetypes())
    formats.pop("pgf", None)  # needs a LaTeX installation at save time
    return formats


def plot_file(out: Path, force: bool) -> Path:
    """The file the plot will really be written to, decided before any modelling. matplotlib picks the
    format from the suffix and appends '.png' where there is none, so say so rather than surprise. An existing file
    there is replaced only with --force (any file was: `--out thesis.pdf` replaced the thesis with a plot)."""
    check_out_file(out, "sweep.png")
    suffix = out.suffix.lower().lstrip(".")
    real = out.with_name(out.name + ".png") if not suffix else out
    if suffix:
        formats = _plot_formats()
        if suffix not in formats:
            _fail(f"--out {out}: image format {suffix!r} is not supported; use a file name ending in one of "
                  f"{', '.join('.' + f for f in sorted(formats))}")
    if (real.exists() or real.is_symlink()) and not force:  # a link too: the write replaces it
        where = f"--out {out}" if real == out else f"--out {out}: {real}"
        _fail(f"{where} already exists: not replaced (--force replaces it)")
    return real


def plot(series: dict[str, list[dict]], over: str, out: Path, title: str) -> None:
    import warnings

    # matplotlib's warnings (a one-point axis, ...) name its source lines: never shown to a CLI user
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _draw(series, over, out, title)


def _draw(series: dict[str, list[dict]], over: str, out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    # group_size 0 (one group per peer) has no place on a log axis: matplotlib put it far outside the axes, so the
    # plot showed fewer points than were modelled; a symmetric log axis is linear below 1 and draws it
    zero = any(r["x"] <= 0 for rows in series.values() for r in rows if "error" not in r)
    for label, rows in series.items():
        ok = [r for r in rows if "error" not in r]
        if not ok:
            continue
        xs = [r["x"] for r in ok]
        a1.plot(xs, [r["latency_us"] for r in ok], marker="o", label=label)
        a2.plot(xs, [max(r["fences"], 0) for r in ok], marker="o", label=label)
    for ax, yl in ((a1, "latency µs (dispatch+combine)"), (a2, "fences per PE")):
        ax.set_xlabel(over)
        ax.set_ylabel(yl)
        if zero:
            ax.set_xscale("symlog", base=2, linthresh=1)
        else:
            ax.set_xscale("log", base=2)
        ax.grid(True, alpha=0.3)
    a1.set_yscale("log")
    a1.legend(fontsize=8)
    fig.suptitle(title + " (MODELLED, not measured)")
    fig.tight_layout()
    from moetune.tuner.store.atomic_files import write_figure

    try:  # atomic: Ctrl-C or a full disk mid-save must not leave an earlier plot of that name truncated
        write_figure(fig, out, dpi=110)
    except (OSError, ValueError) as e:
        _fail(f"--out {out}: cannot write the plot ({getattr(e, 'strerror', None) or e})", write_error_code(e))
    finally:
        plt.close(fig)
