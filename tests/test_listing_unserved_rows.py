"""A stored row no lookup serves (its knobs or key contradict its family: `key_knobs_problem`; a what-if profile no run
of this runtime can take: `runtime_refusal`) is labelled, with why, wherever stored profiles are listed: the store's
`list_profiles` (`ProfileRecord.not_served`), `moetune profiles list` (its table and --json) and `profiles show`, and
the daemon's list_profiles reply (`ProfileResult.not_served`). Listed like any other row, it read as one in use. A
served row carries no label; a client one version older still reads a list of served rows (the field is left out
there), as tests/test_status_reply_older_client.py has it for the status reply."""

from __future__ import annotations

import contextlib
import json
import sqlite3
import sys
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parent))

from moetune.runtime import wire
from moetune.runtime.knobs import default_knobs
from moetune.runtime.profile_record import ProfileKey, ProfileRecord, not_served_label
from moetune.runtime.profiles.errors import BadReply
from moetune.runtime.profiles.replies import decode_reply, decode_result
from moetune.tuner.cli import app
from moetune.tuner.daemon.index import ProfileIndex
from moetune.tuner.store.store import Store

pytestmark = pytest.mark.timeout(120)

QWEN = (2048, 768, 128, 8)
FP = "fp-unserved"


def _key(*, family: str = "nvlink", ep: int = 2, nodes: int = 1, bucket: int = 64) -> ProfileKey:
    return ProfileKey(fingerprint=FP, software="sw", transport_family=family, ep_size=ep, nodes=nodes, hidden=QWEN[0],
                      intermediate=QWEN[1], experts=QWEN[2], topk=QWEN[3], dtype="bfloat16", token_bucket=bucket)


def _served() -> ProfileRecord:
    return ProfileRecord(key=_key(bucket=64), knobs=default_knobs("nvlink"), latency_us=5.0, spread_us=0.1,
                         backend="local:nccl", provenance="measured", measured_on=FP)


def _to_contradict() -> ProfileRecord:  # sound as stored; `_fill` makes it name engine=megakernel
    return ProfileRecord(key=_key(bucket=128), knobs=default_knobs("nvlink"), latency_us=6.0, spread_us=0.1,
                         backend="local:nccl", provenance="measured", measured_on=FP)


def _what_if() -> ProfileRecord:  # proxy at EP 16 over 2 nodes: modelled only, the runtime's proxy cannot run it
    return ProfileRecord(key=_key(family="proxy:ibrc", ep=16, nodes=2, bucket=64), knobs=default_knobs("proxy"),
                         latency_us=9.0, spread_us=0.0, backend=f"model:node:{FP}", provenance="node_model",
                         measured_on=FP)


def _fill(db: Path) -> dict[str, int]:
    """A served row, a contradicting one (as an older moetune's import stored it: the store refuses to write one) and
    a what-if one; their ids by name."""
    with Store(db) as s:
        for rec in (_served(), _to_contradict(), _what_if()):
            s.put_profile(rec)
    with contextlib.closing(sqlite3.connect(db)) as con, con:
        ids = dict(con.execute("SELECT transport_family || ':' || token_bucket, id FROM profiles").fetchall())
        raw = con.execute("SELECT knobs FROM profiles WHERE id = ?", (ids["nvlink:128"],)).fetchone()[0]
        con.execute("UPDATE profiles SET knobs = ? WHERE id = ?",
                    (json.dumps({**json.loads(raw), "engine": "megakernel"}), ids["nvlink:128"]))
    return {"served": ids["nvlink:64"], "contradicting": ids["nvlink:128"], "what_if": ids["proxy:ibrc:64"]}


def _check_labels(labels: dict[int, str | None], ids: dict[str, int]) -> None:
    assert labels[ids["served"]] is None
    odd = labels[ids["contradicting"]]
    assert odd is not None and odd.startswith("contradicts its family") and "knobs.engine" in odd, odd
    what_if = labels[ids["what_if"]]
    assert what_if is not None and what_if.startswith("what-if only") and "at most 8 ranks" in what_if, what_if


def test_the_store_lists_each_row_with_why_it_is_not_served(tmp_path: Path) -> None:
    ids = _fill(tmp_path / "p.db")
    with Store(tmp_path / "p.db") as s:
        rows = s.list_profiles(status="current")
    _check_labels({i: r.not_served for i, r in rows}, ids)
    # the label is the serving rule's (`not_served_label`), not a second one
    assert all(r.not_served == not_served_label(r.key, r.knobs) for _i, r in rows)


def test_profiles_list_labels_them_in_the_table_and_in_json(tmp_path: Path) -> None:
    db = tmp_path / "p.db"
    ids = _fill(db)
    r = CliRunner().invoke(app, ["profiles", "list", "--json", "--db", str(db)])
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)
    _check_labels({x["id"]: x["not_served"] for x in rows}, ids)
    assert [set(x) for x in rows[1:]] == [set(rows[0])] * (len(rows) - 1)  # every row has the same keys
    r = CliRunner().invoke(app, ["profiles", "list", "--db", str(db)], env={"COLUMNS": "300"})
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    row_of = {i: next(ln for ln in lines if [c.strip() for c in ln.split("│")[1:2]] == [str(i)])
              for i in ids.values()}  # the table's row of each id (its first cell)
    assert "NOT SERVED" not in row_of[ids["served"]]
    assert "NOT SERVED" in row_of[ids["contradicting"]] and "NOT SERVED" in row_of[ids["what_if"]]
    flat = " ".join(r.output.split())
    assert f"profile {ids['contradicting']} is NOT SERVED: contradicts its family (knobs.engine" in flat, r.output
    assert f"profile {ids['what_if']} is NOT SERVED: what-if only (" in flat, r.output
    assert f"profile {ids['served']} is NOT SERVED" not in flat
    # `show` says it too, for the contradicting row as for the what-if one; the served row as before
    r = CliRunner().invoke(app, ["profiles", "show", str(ids["contradicting"]), "--db", str(db)],
                           env={"COLUMNS": "300"})
    assert r.exit_code == 0 and "NOT SERVED: contradicts its family" in r.output, r.output
    r = CliRunner().invoke(app, ["profiles", "show", str(ids["what_if"]), "--db", str(db)], env={"COLUMNS": "300"})
    assert r.exit_code == 0 and "what-if only: the runtime cannot run it" in r.output, r.output
    r = CliRunner().invoke(app, ["profiles", "show", str(ids["served"]), "--db", str(db)], env={"COLUMNS": "300"})
    assert r.exit_code == 0 and "NOT SERVED" not in r.output, r.output


def _index(db: Path) -> tuple[ProfileIndex, list[tuple[int, ProfileRecord]]]:
    with Store(db) as s:
        rows = s.list_profiles(status="current")
    facts = SimpleNamespace(fingerprint=FP, software_hash="sw")
    return ProfileIndex([r for _i, r in rows], version=3, facts=facts, stale=[]), rows


def _read_list(raw: bytes) -> wire.ListProfilesResult:
    """As a client reads a daemon's list_profiles reply (unknown fields refused: `replies.decode_result`)."""
    frame = wire.encode_ok(1, "e", msgspec.Raw(raw))
    return decode_result("list_profiles", decode_reply(frame).result)


def test_the_daemons_list_reply_labels_them(tmp_path: Path) -> None:
    ids = _fill(tmp_path / "p.db")
    idx, rows = _index(tmp_path / "p.db")
    got = _read_list(idx.list_page("current", None, 100))
    by_hash = {r.profile_hash: i for i, r in rows}
    _check_labels({by_hash[p.profile_hash]: p.not_served or None for p in got.profiles}, ids)
    # a served row's reply leaves the field out, as before
    served = next(p for p in got.profiles if by_hash[p.profile_hash] == ids["served"])
    assert served.not_served is msgspec.UNSET


def test_a_running_daemon_s_list_reply_labels_them_built_or_cached(tmp_path: Path) -> None:
    """Through the client and a running daemon: the page built on the list worker, the same page from its cache, and
    the history's page (read from the store) all carry the label."""
    import daemon_fakes as F

    from moetune.runtime.profiles.client import ProfileClient
    from moetune.tuner.daemon.server import Daemon

    db = tmp_path / "moetune.db"
    ids = _fill(db)
    with Store(db) as s:
        by_hash = {r.profile_hash: i for i, r in s.list_profiles()}
    facts = F.FakeFacts({"gpu_model": "H200"})
    endpoint = f"ipc://{tmp_path}/run/d.sock"
    d = Daemon(store=F.open_store(db), endpoint=endpoint, discover=lambda: facts,
               rediscover_interval_s=0).start(background=True)
    c = ProfileClient(endpoint, timeout_ms=5000)
    try:
        for status in ("current", "current", "all"):  # built, cached, from the store
            got = c.list_profiles(status=status, limit=100)
            _check_labels({by_hash[p.profile_hash]: p.not_served or None for p in got.profiles}, ids)
    finally:
        c.close()
        d.stop()


def _older_list_type() -> type:
    """ListProfilesResult as the client before `not_served` defines it (its ProfileResult without the field)."""
    fields = []
    for f in msgspec.structs.fields(wire.ProfileResult):
        if f.name == "not_served":
            continue
        fields.append((f.name, f.type) if f.default is msgspec.NODEFAULT else (f.name, f.type, f.default))
    older = msgspec.defstruct("ProfileResult", fields, kw_only=True)
    return msgspec.defstruct("ListProfilesResult", [("version", int), ("fingerprint", str | None),
                                                    ("profiles", list[older])], kw_only=True)  # type: ignore[valid-type]


def test_a_client_one_version_older_reads_a_list_of_served_rows(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    _fill(tmp_path / "p.db")
    idx, rows = _index(tmp_path / "p.db")
    served = [r for _i, r in rows if r.not_served is None]
    page = ProfileIndex(served, version=3, facts=SimpleNamespace(fingerprint=FP, software_hash="sw"),
                        stale=[]).list_page("current", None, 100)
    whole = idx.list_page("current", None, 100)
    monkeypatch.setitem(wire.RESULT_TYPES, "list_profiles", _older_list_type())
    got = _read_list(page)
    assert [p.profile_hash for p in got.profiles] == [r.profile_hash for r in served]
    # where there is something it cannot show, it says so (a newer daemon), as for every such field
    with pytest.raises(BadReply, match=r"unknown fields profiles\.\d+\.not_served"):
        _read_list(whole)
