"""The proxy probe's `qps` changed meaning at library ABI 19 (csrc/mt_common.cu): up to ABI 18 the engine's streams
were shared by every peer (`qps` in all; the committed probe, bench/results/2026-11-30_h200x2_proxy_probe.jsonl, ran
4 streams for its 12 emulated PEs), since ABI 19 `qps` is per peer (npeers x qps streams). A proxy_ce row says the
ABI whose meaning its `qps` has (`abi`); calibration models each meaning as the engine ran it and refuses a row whose
meaning it does not know, naming the row."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moetune.runtime import csrc_build
from moetune.runtime.knobs import Knobs
from moetune.tuner.fabric_model.calibration import read_rows, rows_to_points
from moetune.tuner.fabric_model.predict import predict_transfers
from moetune.tuner.fabric_model.presets import load_preset

ROOT = Path(__file__).resolve().parents[1]
PROBE = ROOT / "bench/results/2026-11-30_h200x2_proxy_probe.jsonl"
ROW = {"probe": "proxy_ce", "size": 65536, "mode": "decoupled_ordered", "transfers": 96, "qps": 4, "us": 500.0}


def test_the_committed_probe_rows_say_their_abi() -> None:
    rows = read_rows([PROBE])
    assert rows and {r["abi"] for r in rows} == {18}
    assert {r["qps"] for r in rows} == {4}


def test_a_qps_without_its_abi_is_refused_naming_the_row(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"row 2 \(probe proxy_ce\).*'abi'"):
        rows_to_points([{**ROW, "abi": 18}, ROW])
    data = tmp_path / "probe.jsonl"
    data.write_text(json.dumps(ROW) + "\n")
    with pytest.raises(ValueError, match=rf"{data} row 1 \(probe proxy_ce\).*'abi'"):
        read_rows([data])
    # an ABI newer than this moetune's library: its meaning is not known here
    with pytest.raises(ValueError, match=r"row 1 \(probe proxy_ce\).*abi"):
        rows_to_points([{**ROW, "abi": csrc_build.ABI_VERSION + 1}])
    # a row that names no qps keeps the preset's streams, whatever its ABI
    bare = {k: v for k, v in ROW.items() if k != "qps"}
    assert len(rows_to_points([bare])[0]) == 1


def test_abi_18_shares_the_streams_abi_19_gives_each_peer_its_own() -> None:
    """coupled + proxy_drain (a signal per PUT, its drain waits on every stream): 12 streams are not 4."""
    preset = load_preset("nvlink-h200x2")
    assert preset.get("nic.shared_qps") == 4
    row = {**ROW, "mode": "coupled_drain"}
    (old,), _ = rows_to_points([{**row, "abi": 18}])
    (new,), _ = rows_to_points([{**row, "abi": 19}])
    (now,), _ = rows_to_points([{**row, "abi": csrc_build.ABI_VERSION}])
    k = Knobs(transport="proxy", signalling="coupled", fence_mode="proxy_drain")
    shared = predict_transfers(preset, 1, 96, 65536, k, destinations=12).time_us
    per_peer = predict_transfers(preset.with_params({"nic.shared_qps": 0}), 1, 96, 65536, k.replace(qps_per_pe=4),
                                 destinations=12).time_us
    assert old.evaluate(preset) == pytest.approx(shared)
    assert new.evaluate(preset) == pytest.approx(per_peer) == now.evaluate(preset)
    assert shared != pytest.approx(per_peer)
