"""The bring-up report's plots show their axis labels whole: tuned.png's y label ("µs (EP: dispatch → combine round
trip; megakernel: layer)") was longer than the 4.2-inch panel, so the saved PNG cut it off at the top and the left
edge. Each panel now names what its family's numbers are (a round trip, or the megakernel's whole layer)."""

from __future__ import annotations

import io
from typing import Any

import pytest

from moetune.tuner.bringup import report


def _row(family: str, tokens: int, ep: int) -> dict[str, Any]:
    return {"model": "qwen3-30b", "family": family, "ep_size": ep, "tokens": tokens, "default_us": 5000.0,
            "default_spread": 2000.0, "tuned_us": 4000.0, "tuned_spread": 100.0}


@pytest.mark.parametrize(("families", "label"), [
    ([("collective", 2)], "µs, dispatch → combine round trip"),
    ([("megakernel", 1)], "µs, the whole MoE layer"),
])
def test_tuned_plot_labels_fit_the_figure(monkeypatch: pytest.MonkeyPatch, families: list[tuple[str, int]],
                                          label: str) -> None:
    saved: list[Any] = []
    real_save = report._save

    def keep(fig: Any, path: Any) -> None:
        real_save(fig, path)  # drawn as the report draws it (dpi, bbox), then measured
        saved.append(fig)

    monkeypatch.setattr(report, "_save", keep)
    rows = [_row(f, s, ep) for f, ep in families for s in (128, 1024)]
    assert report._plot_tuned(rows, io.BytesIO())
    (fig,) = saved
    fig.draw_without_rendering()
    box = fig.bbox
    for ax in fig.axes:
        for text in (ax.yaxis.label, ax.xaxis.label, ax.title):
            ext = text.get_window_extent()
            assert ext.x0 >= box.x0 and ext.y0 >= box.y0 and ext.x1 <= box.x1 and ext.y1 <= box.y1, (text.get_text(), ext, box)
        assert ax.get_ylabel() == label


def test_importance_plot_titles_fit_the_figure(monkeypatch: pytest.MonkeyPatch) -> None:
    """importances.png titled each panel with its study's whole name on one line, wider than the 7-inch figure: the
    PNG cut off its end (the fingerprint, software and restart part telling two studies apart)."""
    saved: list[Any] = []
    real_save = report._save

    def keep(fig: Any, path: Any) -> None:
        real_save(fig, path)
        saved.append(fig)

    monkeypatch.setattr(report, "_save", keep)
    names = [f"collective/qwen3-30b/S{s}/ep2n1/local:gloo:comm/943cc5ad0d04-7796d6ea-89cd533b-r2684b9a0"
             for s in (128, 1024)]
    imp = {n: {"compression": 0.7, "pipeline_depth": 0.3, "scale_granularity": 0.0} for n in names}
    assert report._plot_importances(imp, io.BytesIO())
    (fig,) = saved
    fig.draw_without_rendering()
    box = fig.bbox
    titles = []
    for ax in fig.axes:
        ext = ax.title.get_window_extent()
        assert ext.x0 >= box.x0 and ext.x1 <= box.x1 and ext.y1 <= box.y1, (ax.get_title(), ext, box)
        titles.append(ax.get_title().replace("\n", ""))
    assert sorted(titles) == sorted(names)  # the whole name, only broken into lines
