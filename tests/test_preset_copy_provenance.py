"""Two fabric models of one preset name (the shipped preset and an edited or calibrated copy, which keeps the name)
each have their profile key (`preset:NAME:DIGEST`); what serves their profiles must say which one it serves: the
runtime's modelled fallback (`moetune query`) picks the most recently tuned preset, and its `measured_on` said
`preset:NAME` for either, so the copy's numbers were shown as the shipped preset's."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moetune.tuner.cli import app
from moetune.tuner.fabric_model.presets import load_preset, preset_digest, preset_origin

ROOT = Path(__file__).resolve().parent.parent
NAME = "ndr-ibrc-h100x8"


def _run(*args: str, home: Path, **env: str):
    env = {"MOETUNE_HOME": str(home), "HOME": str(home), "XDG_CONFIG_HOME": str(home / "cfg"), "MOETUNE_CONFIG": "",
           "MOETUNE_DAEMON_SOCKET": f"ipc://{home}/none/daemon.sock", "COLUMNS": "400", **env}
    return CliRunner().invoke(app, list(args), env=env)


def _slow_copy(tmp_path: Path) -> Path:
    shipped = load_preset(NAME)
    slow = tmp_path / "slow.toml"  # the NIC ten times slower, the name unchanged
    slow.write_text(shipped.with_params({"nic.gbps": shipped.get("nic.gbps") / 10}, name=shipped.name).to_toml())
    return slow


def _tune(preset: str, home: Path) -> None:
    r = _run("tune", "--backend", "model", "--preset", preset, "--model", "qwen3-30b", "--tokens", "128", "--nodes", "2",
             "--trials", "2", "--json", home=home)
    assert r.exit_code == 0, r.output


def _query(home: Path, fmt: str):
    q = _run("query", "--model", "qwen3-30b", "--ep", "16", "--nodes", "2", "--tokens", "128", "--format", fmt,
             "--timeout-ms", "100", home=home, MOETUNE_CLIENT_ALLOW_MODELLED="1")
    assert q.exit_code == 0, q.output
    # --format json: stdout alone must be the one JSON document (Result.output also holds stderr)
    return q.stdout if fmt == "json" else q.output


@pytest.fixture(autouse=True)
def _no_gpus() -> None:
    from moetune.runtime.profiles import node_identity

    if node_identity.local_gpu_uuids():  # the node's identity must then match a recorded fingerprint: none does here
        pytest.skip("this node has NVIDIA GPUs: its identity matches no recorded fingerprint in this test")


@pytest.mark.parametrize("copy_last", [True, False])
def test_query_says_which_of_two_presets_of_one_name_it_serves(tmp_path: Path, copy_last: bool) -> None:
    slow = _slow_copy(tmp_path)
    shipped_fp = f"preset:{NAME}:{preset_digest(load_preset(NAME))}"
    copy_fp = f"preset:{NAME}:{preset_digest(load_preset(str(slow)))}"
    for p in ([NAME, str(slow)] if copy_last else [str(slow), NAME]):
        _tune(p, tmp_path)
    got = json.loads(_query(tmp_path, "json"))
    served, other = (copy_fp, shipped_fp) if copy_last else (shipped_fp, copy_fp)
    assert got["key"]["fingerprint"] == served, got  # the most recently tuned preset
    # measured_on names the content served (it said preset:NAME for both), and whether it is the shipped preset's
    assert got["measured_on"] == served, got
    assert got["preset_shipped"] is (not copy_last), got
    msg = re.sub(r"\s+", " ", got["message"])
    assert f"other preset(s) for this shape/EP size/nodes ({other})" in msg, msg
    assert f"the most recently tuned one, {served}, is used" in msg, msg
    table = re.sub(r"\s+", " ", _query(tmp_path, "table"))
    if copy_last:
        assert f"NOT the shipped preset {NAME}: a file of that name with other numbers" in table, table
    else:
        assert f"the shipped preset {NAME}" in table and "NOT the shipped" not in table, table


def test_profiles_show_says_a_copy_is_not_the_shipped_preset(tmp_path: Path) -> None:
    _tune(str(_slow_copy(tmp_path)), tmp_path)
    r = _run("profiles", "show", "1", home=tmp_path)
    assert r.exit_code == 0, r.output
    assert f"NOT the shipped preset {NAME}" in re.sub(r"\s+", " ", r.output), r.output


def test_preset_origin_of_an_older_row_and_of_an_unshipped_name() -> None:
    shipped = preset_digest(load_preset(NAME))
    assert preset_origin(f"preset:{NAME}:{shipped}") == (True, f"the shipped preset {NAME}")
    known, why = preset_origin(f"preset:{NAME}")  # an older moetune's row: which content is not recorded
    assert known is None and "not recorded" in why
    assert preset_origin("preset:my-fabric:0123456789abcdef")[0] is False
    assert preset_origin(f"preset:{NAME}:0123456789abcdef")[0] is False
