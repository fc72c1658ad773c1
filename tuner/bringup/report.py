"""The bring-up report: a Markdown page with PNG plots of what was measured and tuned on this node.

Plots are drawn from plain rows (measurements, tuned-vs-default rows, importances) so the page can be
rebuilt from the database at any time (`moetune report`).
"""

from __future__ import annotations

import datetime as _dt
import io
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from moetune.runtime.profile_record import MEGAKERNEL_FAMILY
from moetune.tuner.store.atomic_files import write_atomic

HEADER = "# moetune bring-up report"  # report.md's first line: what marks it as this module's
# the PNG text chunk (Software) every plot of ours carries: a plot file of that name without it is not ours
PNG_MARK = b"Software\x00" + HEADER[2:].encode()


class NotOurReport(FileExistsError):
    """A file the report would replace in its folder was not written by moetune: nothing is written."""


@dataclass
class ReportData:
    node: str  # short description of the node (GPU model × count, fingerprint)
    fingerprint: str
    measurements: list[dict] = field(default_factory=list)  # MicroResult-like dicts
    # {model, tokens, default_us, default_spread, tuned_us, tuned_spread, knobs, source, stored, why_default, written,
    # reason}: every compared bucket; a time is NaN where that run failed
    tuned: list[dict] = field(default_factory=list)
    importances: dict[str, dict[str, float]] = field(default_factory=dict)  # study -> {param: importance}
    transports: list[tuple[str, str]] = field(default_factory=list)  # (family, reason)
    # the families discovery found this node cannot run, with why (no NVLink, no ACTIVE IB port, no GPUDirect RDMA)
    unavailable: list[tuple[str, str]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # what discovery could not read (its facts are incomplete)
    notes: list[str] = field(default_factory=list)


def _fmt_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:g} {unit}"
        n /= 1024
    return f"{n:g} TiB"


def _curves(rows: Iterable[dict], kind: str) -> dict[str, list[tuple[int, float, float]]]:
    series: dict[str, list[tuple[int, float, float]]] = defaultdict(list)
    for r in rows:
        if r["kind"] == kind:
            series[f"{r['transport']} {r.get('direction', '')}".strip()].append(
                (r["size_bytes"], r["value"], r.get("spread", 0.0))
            )
    return {k: sorted(v) for k, v in series.items()}


def _plot_curves(rows: Sequence[dict], kind: str, ylabel: str, path: Path | IO[bytes], title: str) -> bool:
    series = _curves(rows, kind)
    if not series:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for label, pts in sorted(series.items()):
        xs, ys, es = zip(*pts, strict=True)
        ax.errorbar(xs, ys, yerr=es, marker="o", capsize=3, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)
    return True


def _save(fig: Figure, path: Path | IO[bytes]) -> None:
    fig.savefig(path, dpi=110, format="png", metadata={"Software": HEADER[2:]})  # PNG_MARK: the plot is ours


def _direction(r: dict) -> str:
    return r.get("direction") or (r.get("extra") or {}).get("direction", "")


def _plot_efficiency(rows: Sequence[dict], path: Path | IO[bytes]) -> bool:
    """One panel per message size; a line per (mode, direction) against concurrency."""
    pts = [r for r in rows if r["kind"] == "signalled_efficiency"]
    if not pts:
        return False
    sizes = sorted({r["size_bytes"] for r in pts})
    fig, axes = plt.subplots(1, len(sizes), figsize=(4.6 * len(sizes), 4.2), squeeze=False, sharey=True)
    for ax, size in zip(axes[0], sizes, strict=True):
        series: dict[tuple[str, str], list[tuple[int, float]]] = defaultdict(list)
        for r in pts:
            if r["size_bytes"] == size:
                extra = r.get("extra") or {}
                series[(extra.get("mode", "?"), _direction(r))].append((extra.get("concurrency", 0), r["value"]))
        modes = sorted({m for m, _ in series})
        colours = {m: f"C{i}" for i, m in enumerate(modes)}
        for (mode, d), xy in sorted(series.items()):
            xy.sort()
            ax.plot([x for x, _ in xy], [100 * y for _, y in xy], marker="o", color=colours[mode],
                    linestyle="-" if d in ("", "0->1") else "--", label=f"{mode} {d}".strip())
        ax.set_xscale("log")
        ax.set_xlabel("concurrent transfers")
        ax.set_title(f"{_fmt_size(size)} messages", fontsize=10)
        ax.set_ylim(0, 115)
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("% of put-only throughput")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=7, frameon=False)
    fig.suptitle("Signalled vs put-only throughput (measured)")
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    _save(fig, path)
    plt.close(fig)
    return True


def _fence_table(rows: Sequence[dict]) -> list[str]:
    """Markdown rows: measured cost of one fence (coupled signalling), per fence mode, size and concurrency."""
    pts = [r for r in rows if r["kind"] == "fence_cost"]
    if not pts:
        return []
    cells: dict[tuple[str, int, int], list[float]] = defaultdict(list)
    for r in pts:
        extra = r.get("extra") or {}
        cells[(extra.get("fence_mode", "?"), r["size_bytes"], extra.get("concurrency", 0))].append(r["value"])
    concs = sorted({c for _, _, c in cells})
    md = ["## Cost of one fence (measured, µs per fence, mean of both directions)", "",
          "| fence mode | message | " + " | ".join(f"c={c}" for c in concs) + " |",
          "| --- | --- | " + " | ".join("---:" for _ in concs) + " |"]
    for mode, size in sorted({(m, s) for m, s, _ in cells}):
        vals = [cells.get((mode, size, c)) for c in concs]
        md.append(f"| `{mode}` | {_fmt_size(size)} | "
                  + " | ".join(f"{sum(v) / len(v):.2f}" if v else "–" for v in vals) + " |")
    return [*md, ""]


def _measured(v: object) -> bool:
    return isinstance(v, int | float) and math.isfinite(v)


def _plot_tuned(tuned: Sequence[dict], path: Path | IO[bytes]) -> bool:
    # a bar pair needs both times; a bucket with a failed run is in the table, saying why
    tuned = [t for t in tuned if _measured(t.get("default_us")) and _measured(t.get("tuned_us"))]
    if not tuned:
        return False
    groups = sorted({(t["model"], t.get("family", ""), t.get("ep_size") or 0) for t in tuned})
    fig, axes = plt.subplots(1, len(groups), figsize=(4.2 * len(groups), 4.2), squeeze=False)
    for ax, (model, family, ep) in zip(axes[0], groups, strict=True):
        rows = sorted((t for t in tuned if (t["model"], t.get("family", ""), t.get("ep_size") or 0) == (model, family, ep)),
                      key=lambda t: t["tokens"])
        xs = list(range(len(rows)))
        w = 0.38
        ax.bar([x - w / 2 for x in xs], [t["default_us"] for t in rows], w,
               yerr=[t.get("default_spread", 0) for t in rows], label="policy default", color="#999999")
        ax.bar([x + w / 2 for x in xs], [t["tuned_us"] for t in rows], w,
               yerr=[t.get("tuned_spread", 0) for t in rows], label="tuned", color="#2a7ab9")
        for x, t in zip(xs, rows, strict=True):
            if t["tuned_us"] > 0:
                ax.text(x, max(t["default_us"], t["tuned_us"]) * 1.02, f"{t['default_us'] / t['tuned_us']:.2f}×",
                        ha="center", fontsize=8)
        ax.set_xticks(xs, [str(t["tokens"]) for t in rows])
        ax.set_xlabel("tokens per rank (bucket)")
        # what this panel's family times, in a label that fits the panel: "µs (EP: dispatch → combine round trip;
        # megakernel: layer)" on every panel was taller than it and cut off in the PNG
        ax.set_ylabel("µs, the whole MoE layer" if family == MEGAKERNEL_FAMILY else "µs, dispatch → combine round trip")
        title = f"{model} · {family}" if family else model
        ax.set_title(f"{title} · EP {ep}" if ep else title, fontsize=10)
        ax.legend(fontsize=8)
        ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)
    return True


def _plot_importances(importances: dict[str, dict[str, float]], path: Path | IO[bytes]) -> bool:
    studies = {k: v for k, v in importances.items() if v}
    if not studies:
        return False
    fig, axes = plt.subplots(len(studies), 1, figsize=(7, 1.2 + 1.6 * len(studies)), squeeze=False)
    for ax, (study, imp) in zip(axes[:, 0], sorted(studies.items()), strict=True):
        items = sorted(imp.items(), key=lambda kv: kv[1])
        ax.barh([k for k, _ in items], [v for _, v in items], color="#d9822b")
        # two lines, the key's readable part over its fingerprint/software part: on one line the name was wider than
        # the figure and its end, which tells two studies of one key apart, was cut off
        head, _, tail = study.rpartition("/")
        ax.set_title(f"{head}/\n{tail}" if head else tail, fontsize=9)
        ax.set_xlim(0, 1)
    axes[-1, 0].set_xlabel("importance (fANOVA)")
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)
    return True


PLOT_FILES = ("latency.png", "bandwidth.png", "signalled.png", "tuned.png", "importances.png")


def _plots_of_earlier_report(path: Path) -> set[str]:
    """The plots a report this module wrote at `path` before shows (only those it may replace or remove: a file of
    that name that no earlier report of ours showed, and that carries no `PNG_MARK`, is the user's)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return set()
    if not text.startswith(HEADER):
        return set()
    return {f for f in PLOT_FILES if f"]({f})" in text}


def foreign_report(out_dir: Path) -> str | None:
    """Why `out_dir/report.md` may not be replaced (None when it may: absent, or a report this module wrote): the
    report never overwrites a file moetune did not write. Checked before a bring-up runs (`--report-dir`, `--out`)
    and again when the report is written."""
    path = out_dir / "report.md"
    if not path.exists() and not path.is_symlink():
        return None
    try:
        with path.open("rb") as f:
            head = f.read(len(HEADER.encode()))
    except OSError as e:  # a folder named report.md, a file this user may not read: not known to be ours
        return f"{path} cannot be read to check that moetune wrote it ({e.strerror or e}), so it is not replaced"
    if head == HEADER.encode():
        return None
    return f"{path} was not written by moetune (its first line is not \"{HEADER}\"), so it is not replaced"


def _our_plot(path: Path, earlier: set[str]) -> bool:
    """Whether the plot file `path` is this module's (it may be replaced): it carries `PNG_MARK`, or the earlier
    report of ours in its folder shows it (a plot from before the mark)."""
    if path.name in earlier:
        return True
    try:
        with path.open("rb") as f:
            head = f.read(4096)  # the text chunks come before the image data
    except OSError:
        return False
    return head.startswith(b"\x89PNG") and PNG_MARK in head.split(b"IDAT", 1)[0]


def write_report(data: ReportData, out_dir: Path) -> Path:
    """Write `report.md` and its PNGs into out_dir; returns the Markdown path. NotOurReport (nothing written) when
    it would replace a report.md or a plot file that moetune did not write."""
    out_dir.mkdir(parents=True, exist_ok=True)
    problem = foreign_report(out_dir)
    if problem:
        raise NotOurReport(problem)
    md: list[str] = [
        HEADER,
        "",
        f"- node: {data.node}",
        f"- fabric fingerprint: `{data.fingerprint}`",
        f"- written: {_dt.datetime.now(_dt.UTC).strftime('%Y-%m-%d %H:%M UTC')}",
        "",
    ]
    if data.transports:
        md += ["## Transports found", "", "| family | why |", "| --- | --- |"]
        md += [f"| `{name}` | {reason} |" for name, reason in data.transports]
        md.append("")
    if data.unavailable:  # what this node cannot run is said, never only left out of the table above
        md += ["## Transports not available on this node (not tuned)", "", "| family | why not |", "| --- | --- |"]
        md += [f"| `{name}` | {reason} |" for name, reason in data.unavailable]
        md.append("")
    if data.warnings:
        md += ["## Discovery warnings", "", *[f"- {w}" for w in data.warnings], ""]
    plots = [
        ("latency.png", "Latency against message size (measured)",
         lambda p: _plot_curves(data.measurements, "latency", "one-way latency (µs)", p, "Latency (measured)")),
        ("bandwidth.png", "Bandwidth against message size (measured)",
         lambda p: _plot_curves(data.measurements, "bandwidth", "GB/s", p, "Bandwidth (measured)")),
        ("signalled.png", "Signalled against put-only throughput (measured)",
         lambda p: _plot_efficiency(data.measurements, p)),
        ("tuned.png", "Tuned against policy default, per token bucket (measured side by side)",
         lambda p: _plot_tuned(data.tuned, p)),
        ("importances.png", "Which knobs mattered", lambda p: _plot_importances(data.importances, p)),
    ]
    earlier = _plots_of_earlier_report(out_dir / "report.md")
    drawn: dict[str, bytes] = {}
    for fname, _title, draw in plots:  # drawn in memory: a plot file not ours is found before anything is written
        buf = io.BytesIO()
        if draw(buf):
            drawn[fname] = buf.getvalue()
    theirs = [out_dir / f for f in drawn if (out_dir / f).exists() and not _our_plot(out_dir / f, earlier)]
    if theirs:
        raise NotOurReport(f"{', '.join(map(str, theirs))} {'was' if len(theirs) == 1 else 'were'} not written by "
                           "moetune (no plot mark, and no report of its own in that folder shows it), so the report's "
                           "plot of that name does not replace it")
    stale: list[Path] = []
    for fname, title, _draw in plots:
        if fname in drawn:
            write_atomic(out_dir / fname, drawn[fname])
            md += [f"## {title}", "", f"![{title}]({fname})", ""]
        elif fname in earlier:  # the last report's plot, not this one's (another node's curves beside this report)
            stale.append(out_dir / fname)
    md += _fence_table(data.measurements)
    if data.tuned:
        md += ["## Tuned settings", "",
               "| family | model | EP | tokens | default µs | tuned µs | speedup | knobs | stored | measured by |",
               "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- | --- | --- |"]
        for t in sorted(data.tuned, key=lambda t: (t.get("family", ""), t["model"], t.get("ep_size") or 0, t["tokens"])):
            d, u = t.get("default_us"), t.get("tuned_us")
            sp = f"{d / u:.2f}×" if _measured(d) and _measured(u) and u else "–"
            knobs = ("`" + t["knobs"] + "`") if t.get("knobs") else "(policy default)"
            md.append(f"| {t.get('family', '')} | {t['model']} | {t.get('ep_size') or '–'} | {t['tokens']} "
                      f"| {_time(d, t.get('default_spread', 0))} | {_time(u, t.get('tuned_spread', 0))} | {sp} "
                      f"| {knobs} | {_cell(_stored(t))} | {t.get('source', '')} |")
        md.append("")
    if data.notes:
        md += ["## Notes", "", *[f"- {n}" for n in data.notes], ""]
    path = out_dir / "report.md"
    write_atomic(path, "\n".join(md))  # a crash mid-write leaves the previous report whole
    # only once no report.md names them: removed before, a kill in between left the earlier report showing a
    # plot that was gone
    for p in stale:
        p.unlink(missing_ok=True)
    return path


def _time(us: object, spread: object) -> str:
    return f"{us:.1f} ± {spread or 0:.1f}" if _measured(us) else "failed"


def _stored(t: dict) -> str:
    """What the bucket's profile is now, and why: the tuned setting, or the policy default and the reason."""
    which = t.get("stored", "")
    if "written" in t and not t["written"]:  # the store kept its current profile, or nothing could be measured
        why = str(t.get("reason", "")).removeprefix("not stored: ")
        return f"not stored ({which} chosen): {why}" if which else f"not stored: {why}"
    if which == "policy default" and t.get("why_default"):
        return f"policy default: {t['why_default']}"
    return which


def _cell(text: str) -> str:
    """Text in a Markdown table cell: a `|` (an error may hold one) would split the row."""
    return " ".join(text.replace("|", "\\|").split())
