"""`moetune model sweep --over group_size`: the points mean something. A decoupled group_size groups a peer's PUTs
(proxy, ibgda) or CTAs (nvlink): with chunk_tokens 0 a peer gets ONE PUT, so the default sweep picks a chunk_tokens
giving several PUTs and says so; a group size above the transfers per peer is n/a with the reason (it is the same run
as group_size 0); a transport with no signal groups is refused."""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from moetune.runtime.knobs import default_knobs
from moetune.runtime.shapes import get_model
from moetune.tuner.cli import app
from moetune.tuner.fabric_model.group_grids import busiest_peer_rows, group_grid, transfers_per_peer
from moetune.tuner.fabric_model.presets import load_preset
from moetune.tuner.fabric_model.records import Workload

runner = CliRunner()


def _sweep(*args: str):
    r = runner.invoke(app, ["model", "sweep", *args])
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    return r


def _flat(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize("preset", ["ndr-ibgda-h100x8", "ndr-ibrc-h100x8", "slingshot11-libfabric-a100x4"])
def test_default_group_size_sweep_picks_a_chunk_and_says_so(preset: str) -> None:
    r = _sweep("-p", preset, "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    chunk = doc["knobs"]["chunk_tokens"]
    assert chunk > 0, doc["knobs"]  # not chunk_tokens 0: one PUT per peer, one point
    # the chunk gives 8 chunks of the busiest peer's rows; the points are the divisors of the most PUTs the model
    # charges a peer with it (group_grid: the expected PUTs shared out, 8 here or one more)
    puts = _model_puts(preset, doc, chunk)
    assert puts in (8, 9), puts
    for rows in doc["series"].values():
        assert [p["x"] for p in rows] == _divisors(puts) and all("error" not in p for p in rows), rows
    decoupled = [s for label, s in doc["series"].items() if label.startswith("decoupled")]
    assert decoupled and all(len({p["fences"] for p in s}) == len(_divisors(puts)) for s in decoupled)  # it matters
    assert any(f"chunk_tokens={chunk} for this sweep" in n and "chunk_tokens=0" in n for n in doc["notes"]), doc
    text = _flat(_sweep("-p", preset).output)
    assert f"note: chunk_tokens={chunk} for this sweep ({puts} PUTs to the busiest peer)" in text
    assert "the busiest peer's" in text and "-k chunk_tokens=N" in text


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _model_puts(preset: str, doc: dict, chunk: int) -> int:
    """The most PUTs the model charges a peer in the sweep's workload with `chunk` (its grid)."""
    wl = doc["workload"]
    w = Workload(get_model(wl["model"]), wl["tokens_per_gpu"], wl["nodes"], wl["gpus_per_node"])
    return group_grid(load_preset(preset), w, default_knobs(doc["knobs"]["transport"]).replace(chunk_tokens=chunk))


@pytest.mark.parametrize(("tokens", "chunks"), [(40, 10), (8, 2), (256, 8), (1024, 8)])
def test_the_chunk_gives_eight_puts_where_the_rows_allow(tokens: int, chunks: int) -> None:
    """ceil(rows / 8) gave 5 PUTs for 10 rows (-t 40): a chunk cutting the busiest peer's rows in exactly 8 where
    some chunk does, else the fewest above (10 rows: 10), or as many as there are rows (2). The PUTs the note gives
    and the last point are the model's (group_grid: those chunks' expectation shared out, one more for some peers)."""
    doc = json.loads(_sweep("-p", "ndr-ibrc-h100x8", "-t", str(tokens), "--json").stdout)
    chunk = doc["knobs"]["chunk_tokens"]
    rows = math.ceil(busiest_peer_rows(Workload(get_model(doc["workload"]["model"]), tokens,
                                                doc["workload"]["nodes"], 8)) - 1e-9)
    assert math.ceil(rows / chunk) == chunks, (rows, chunk)
    puts = _model_puts("ndr-ibrc-h100x8", doc, chunk)
    assert puts - chunks in (0, 1), (puts, chunks)
    assert f"({puts} PUTs to the busiest peer)" in doc["notes"][0], doc["notes"]
    assert [p["x"] for p in doc["series"]["decoupled/nic_ordered"]][-1] == puts


def test_a_chunk_tokens_given_is_kept_and_one_put_per_peer_is_said() -> None:
    r = _sweep("-p", "ndr-ibgda-h100x8", "-k", "chunk_tokens=0", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["knobs"]["chunk_tokens"] == 0
    assert [p["x"] for p in doc["series"]["decoupled/nic_ordered"]] == [1]
    assert any(n.startswith("one transfer per peer with chunk_tokens=0") and "pass -k chunk_tokens=N" in n
               for n in doc["notes"]), doc["notes"]


def test_group_sizes_above_the_transfers_per_peer_are_na_with_the_reason() -> None:
    # chunk_tokens 0: one PUT per peer, so 1000 groups the same single PUT as 0 and 1 (three identical rows before)
    r = _sweep("-p", "ndr-ibgda-h100x8", "--values", "0,1,1000", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    dec = {p["x"]: p for p in doc["series"]["decoupled/nic_ordered"]}
    assert "error" not in dec[0] and "error" not in dec[1]
    assert dec[1000]["error"] == ("a group_size above the 1 PUT per peer makes one group per peer: the same run as "
                                  "group_size 0")
    assert all("error" not in p for p in doc["series"]["coupled/nic_ordered"])  # coupled does not group
    assert doc["knobs"]["chunk_tokens"] == 0  # --values: the knobs as given
    assert any(n.startswith("one transfer per peer") for n in doc["notes"])
    text = _flat(_sweep("-p", "ndr-ibgda-h100x8", "--values", "0,1,1000").output)
    assert "n/a (1)" in text and "(1) a group_size above the 1 PUT per peer makes one group per peer" in text
    # with 8 PUTs per peer, 8 is the last point that differs from 0
    r = _sweep("-p", "ndr-ibgda-h100x8", "-k", "chunk_tokens=8", "--values", "3,8,9", "--json")
    dec = {p["x"]: p for p in json.loads(r.stdout)["series"]["decoupled/nic_ordered"]}
    assert "error" not in dec[3] and "error" not in dec[8] and "above the 8 PUTs per peer" in dec[9]["error"]


def test_a_transport_without_signal_groups_is_refused() -> None:
    r = _sweep("-p", "pcie4-consumer-4090x4")  # host_staged: the model reads no group_size
    assert r.exit_code == 2, r.output
    assert "--over group_size: transport 'host_staged' has no signal groups" in _flat(r.output)
    assert "MODELLED" not in r.output
    assert "preset 'pcie4-consumer-4090x4' has no transport with signal groups" in _flat(r.output)
    r = _sweep("-p", "ndr-ibrc-h100x8", "-k", "transport=collective,fence_mode=none")
    assert r.exit_code == 2 and "transport 'collective' has no signal groups" in _flat(r.output), r.output
    # the refusal's suggestions are commands that work (fence_mode 'none' is not possible on proxy)
    r = _sweep("-p", "nvlink-h200x2", "-k", "transport=collective")
    suggested = [a.rstrip(",;") for a in _flat(r.output).split("-k ")[1:]]
    assert suggested and all(a.startswith("transport=") for a in suggested), r.output
    for knobs in suggested:
        assert _sweep("-p", "nvlink-h200x2", "-k", knobs.split()[0]).exit_code == 0, knobs


def test_nvlink_sweeps_its_ctas_and_says_when_nothing_changes() -> None:
    r = _sweep("-p", "nvlink-h200x2", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    # 24 SMs over 2 GPUs: 12 CTAs per peer
    assert [p["x"] for p in doc["series"]["decoupled/none"]] == [1, 2, 3, 4, 6, 12]
    assert any("group_size changes nothing in the nvlink prediction" in n for n in doc["notes"]), doc["notes"]


def test_group_grid_follows_the_models_transfers() -> None:
    shape = get_model("qwen3-30b")
    pr = load_preset("slingshot11-libfabric-a100x4")
    w = Workload(shape, 256, 4, pr.gpus_per_node)
    k = default_knobs("proxy")
    assert group_grid(pr, w, k) == transfers_per_peer(w, 0) == 1
    assert group_grid(pr, w, k.replace(chunk_tokens=8)) == transfers_per_peer(w, 8) == 14
    # zipf routing: the busiest peer's PUTs, more than a uniform peer's
    wz = Workload(shape, 256, 4, pr.gpus_per_node, routing="zipf:1.2")
    assert group_grid(pr, wz, k.replace(chunk_tokens=8)) > 14
    nv = load_preset("nvlink-h200x2")
    assert group_grid(nv, Workload(shape, 256, 1, 2), default_knobs("nvlink")) == 12
    assert group_grid(nv, Workload(shape, 256, 1, 2), default_knobs("collective")) == 0


# -- --out in a folder that does not exist: refused, nothing created (as for --db) ---------------------------------
@pytest.mark.parametrize("cmd", ["sweep", "calibrate"])
def test_out_in_a_missing_folder_is_refused_and_not_created(tmp_path, cmd: str) -> None:
    out = tmp_path / "new" / "dir" / ("x.png" if cmd == "sweep" else "cal.toml")
    if cmd == "sweep":
        args = ["-p", "ndr-ibgda-h100x8", "--out", str(out)]
    else:
        data = tmp_path / "rows.jsonl"
        data.write_text(json.dumps({"probe": "nccl_a2a", "fabric": "nvlink", "model": "qwen3-30b", "S": 4096,
                                    "world": 2, "ms": 0.29}) + "\n")
        args = ["-p", "nvlink-h200x2", "-d", str(data), "--out", str(out), "--force"]
    r = runner.invoke(app, ["model", cmd, *args])
    assert r.exit_code == 2, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert f"--out {out}: the folder {out.parent} does not exist" in _flat(r.output), r.output
    assert "MODELLED" not in r.output  # refused before the sweep or the fit
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("over", ["group_size", "tokens"])
def test_a_decoupled_group_size_given_leaves_the_coupled_series_modelled(over: str) -> None:
    """-k signalling=decoupled,group_size=4: the coupled series the sweep adds are valid settings (coupled has no
    group size). They were n/a at every point, "an invalid or unsafe setting", because the user's group_size was
    kept on them."""
    r = _sweep("-p", "ndr-ibrc-h100x8", "--over", over, "-k", "signalling=decoupled,group_size=4", "--json")
    assert r.exit_code == 0, r.output
    series = json.loads(r.stdout)["series"]
    for label, rows in series.items():
        assert label.startswith(("coupled/", "decoupled/"))
        if label.startswith("coupled/"):
            assert all("error" not in row for row in rows), (label, rows)
    if over == "tokens":  # the decoupled series keep the group size given
        plain = _sweep("-p", "ndr-ibrc-h100x8", "--over", over, "-k", "signalling=decoupled", "--json")
        assert json.loads(plain.stdout)["series"]["coupled/proxy_drain"] == series["coupled/proxy_drain"]


def test_the_plot_draws_a_group_size_of_zero(tmp_path, monkeypatch) -> None:
    """`--values 0,1,2,4` (0: one group per peer, a valid group size) on the log2 x axis: the point at 0 has no place
    there, so matplotlib dropped it without a word and the plot showed fewer modelled points than the table. Every
    point the sweep modelled lands inside the axes."""
    import moetune.tuner.store.atomic_files as atomic_files

    drawn = []

    def keep(fig, path, **kw):  # the figure as written (plot closes it afterwards)
        for ax in fig.axes:
            box = ax.get_window_extent()
            for line in ax.get_lines():
                xy = ax.transData.transform(list(zip(line.get_xdata(), line.get_ydata(), strict=True)))
                drawn.append((float(line.get_xdata()[0]), xy))
                for px, py in xy:
                    assert box.x0 - 1 <= px <= box.x1 + 1 and box.y0 - 1 <= py <= box.y1 + 1, (line.get_label(), px, py)
        path.write_bytes(b"")

    monkeypatch.setattr(atomic_files, "write_figure", keep)
    out = tmp_path / "g.png"
    r = _sweep("-p", "ndr-ibrc-h100x8", "--over", "group_size", "--values", "0,1,2,4", "-k", "chunk_tokens=16",
               "--out", str(out))
    assert r.exit_code == 0, r.output
    assert drawn and all(x0 == 0 for x0, _ in drawn)  # every series starts at its group size 0


def test_the_grid_is_the_most_puts_the_model_charges_a_peer() -> None:
    """qwen3-30b on 2 x 8 GPUs, S = 2, chunk_tokens 1: the model charges a set of peers its expected PUTs shared out
    by largest remainder (phases/queued.py), some peers 2 (remote: round(8 x 0.82) = 7 PUTs on the 5 peers that get
    rows), so decoupled group_size 1 is another run than 0. The grid chunked the busiest peer's mean rows (0.82: one
    PUT) and the sweep said "group_size has nothing to group" beside a table where 0 and 1 differ."""
    pr = load_preset("ndr-ibrc-h100x8")
    w = Workload(get_model("qwen3-30b"), 2, 2, 8)
    k = default_knobs("proxy").replace(chunk_tokens=1, signalling="decoupled")
    assert group_grid(pr, w, k) == 2
    doc = json.loads(_sweep("-p", "ndr-ibrc-h100x8", "-m", "qwen3-30b", "-n", "2", "-t", "2", "-k", "chunk_tokens=1",
                            "--json").stdout)
    assert not any("nothing to group" in n for n in doc["notes"]), doc["notes"]
    dec = {p["x"]: p for p in doc["series"]["decoupled/proxy_drain"]}
    assert sorted(dec) == [1, 2] and all("error" not in p for p in dec.values()), dec
    r = _sweep("-p", "ndr-ibrc-h100x8", "-m", "qwen3-30b", "-n", "2", "-t", "2", "-k", "chunk_tokens=1",
               "--values", "0,1,2,3", "--json")
    dec = {p["x"]: p for p in json.loads(r.stdout)["series"]["decoupled/proxy_drain"]}
    assert dec[1]["latency_us"] != dec[0]["latency_us"] and dec[2]["latency_us"] == dec[0]["latency_us"], dec
    assert "above the 2 PUTs per peer" in dec[3]["error"], dec
