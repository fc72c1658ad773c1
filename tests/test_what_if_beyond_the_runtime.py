"""A model tune of a cross-node proxy preset (ndr-ibrc-h100x8 on 4 nodes: EP 32) stores profiles of transport proxy at
EP 32, which the runtime's proxy transport cannot run (`check_world`: at most MAX_WORLD ranks, one node), so autoload
passes over them. They are kept as what-if reports (the Perseus IBRC model at that scale: the only place its tuned
settings are written down), labelled MODELLED as every preset profile is, and the three say the same thing from one
rule (`runtime.knobs.group_world_problem`, torch-free; host_staged across nodes too):

* the store keeps them modelled and refuses one labelled measured (no run can have measured it);
* the tune's report (its table's note and --json's `runtime_refusal`) and `profiles show` say the runtime cannot run
  it and autoload passes over it;
* autoload's `transport_world_problem` gives the same reason."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import msgspec
import pytest
from typer.testing import CliRunner

from moetune.runtime.knobs import MAX_WORLD, Knobs, one_sided_world_problem
from moetune.runtime.profile_record import ProfileKey, ProfileRecord, runtime_refusal
from moetune.runtime.profiles.autoload import transport_world_problem
from moetune.tuner.cli import app
from moetune.tuner.store.store import Store
from moetune.tuner.store.validate import FieldError

runner = CliRunner()


def _tune(tmp_path: Path, *extra: str) -> tuple[int, str]:
    r = runner.invoke(app, ["tune", "-m", "qwen3-30b", "-t", "256", "--backend", "model", "-p", "ndr-ibrc-h100x8",
                            "--nodes", "4", "--trials", "3", "--db", str(tmp_path / "p.db"),
                            "--storage", f"sqlite:///{tmp_path / 's.db'}", *extra], env={"COLUMNS": "300"})
    return r.exit_code, r.stdout if "--json" in extra else r.output


def test_the_rule_is_the_runtimes() -> None:
    why = one_sided_world_problem("proxy", 32)
    assert why is not None and f"at most {MAX_WORLD} ranks" in why
    assert transport_world_problem("proxy", 32) == f"knob transport: {why}"
    assert one_sided_world_problem("proxy", MAX_WORLD) is None and one_sided_world_problem("collective", 32) is None
    assert transport_world_problem("proxy", MAX_WORLD) is None


def test_a_cross_node_proxy_tune_is_stored_modelled_and_reported_as_what_if(tmp_path: Path) -> None:
    code, out = _tune(tmp_path)
    assert code == 0, out
    flat = " ".join(out.split())
    assert "new (what-if)" in flat, out
    assert "the runtime cannot run it" in flat and "at most 8 ranks" in flat and "autoload passes over it" in flat
    with sqlite3.connect(tmp_path / "p.db") as db:
        rows = db.execute("SELECT id, provenance, ep_size, status FROM profiles").fetchall()
    assert [(r[1], r[2], r[3]) for r in rows] == [("preset", 32, "current")]
    show = runner.invoke(app, ["profiles", "show", str(rows[0][0]), "--db", str(tmp_path / "p.db")],
                         env={"COLUMNS": "300"})
    assert show.exit_code == 0, show.output
    flat = " ".join(show.output.split())
    assert "what-if only: the runtime cannot run it" in flat and "at most 8 ranks" in flat, show.output
    code, out = _tune(tmp_path, "--json")
    assert code == 0, out
    (row,) = json.loads(out)
    assert row["modelled"] is True and "at most 8 ranks" in row["runtime_refusal"]


def test_a_profile_the_runtime_can_run_is_reported_as_before(tmp_path: Path) -> None:
    r = runner.invoke(app, ["tune", "-m", "qwen3-30b", "-t", "256", "--backend", "model", "-p", "ndr-ibrc-h100x8",
                            "--trials", "3", "--db", str(tmp_path / "p.db"), "--storage",
                            f"sqlite:///{tmp_path / 's.db'}", "--json"], env={"COLUMNS": "300"})
    assert r.exit_code == 0, r.output
    (row,) = json.loads(r.stdout)
    assert row["runtime_refusal"] is None


def test_the_store_refuses_such_a_profile_labelled_measured(tmp_path: Path) -> None:
    key = ProfileKey(fingerprint="fpA", software="sw", transport_family="proxy:ibrc", ep_size=32, nodes=4, hidden=2048,
                     intermediate=768, experts=128, topk=8, dtype="bfloat16", token_bucket=256)
    knobs = Knobs(transport="proxy", fence_mode="proxy_drain")
    s = Store(tmp_path / "p.db")
    with pytest.raises(FieldError, match="at most 8 ranks"):
        s.put_profile(ProfileRecord(key=key, knobs=knobs, latency_us=50, spread_us=1, backend="local:nccl",
                                    provenance="measured", measured_on="fpA"))
    ok, why = s.put_profile(ProfileRecord(key=key, knobs=knobs, latency_us=50, spread_us=1,
                                          backend="model:ndr-ibrc-h100x8", provenance="preset"))
    assert ok, why


def test_a_cross_node_group_within_max_world_is_beyond_the_runtime_too(tmp_path: Path) -> None:
    """2 nodes x 4 GPUs (slingshot11-libfabric-a100x4 on 2 nodes: EP 8) is within MAX_WORLD, but the runtime's
    one-sided transports store into the GPUs of one node only (CUDA IPC / symmetric memory), so such a proxy profile
    is as much a what-if report as one at EP 32: the rule knows the key's node count, autoload's check is given the
    group's, and the tune reports it so."""
    why = one_sided_world_problem("proxy", 8, nodes=2)
    assert why is not None and "one node" in why and "2 nodes" in why, why
    assert one_sided_world_problem("nvlink", 4, nodes=2) is not None
    assert one_sided_world_problem("proxy", MAX_WORLD, nodes=1) is None
    assert one_sided_world_problem("collective", 8, nodes=2) is None
    # the rank count is still said first where both are off (EP 32 on 4 nodes: as before)
    assert "at most 8 ranks" in (one_sided_world_problem("proxy", 32, nodes=4) or "")
    assert transport_world_problem("proxy", 8, nodes=2) == f"knob transport: {why}"
    assert transport_world_problem("proxy", 8, nodes=1) is None

    key = ProfileKey(fingerprint="fpA", software="sw", transport_family="proxy:libfabric/cxi", ep_size=8, nodes=2,
                     hidden=2048, intermediate=768, experts=128, topk=8, dtype="bfloat16", token_bucket=256)
    assert runtime_refusal(key, Knobs(transport="proxy", fence_mode="proxy_drain")) == why
    assert runtime_refusal(msgspec.structs.replace(key, nodes=1), Knobs(transport="proxy", fence_mode="proxy_drain")) is None

    # autoload gives its world check the group's node count (a 2-node group with allow_modelled took such a profile)
    class _Asks:
        def resolve(self, *, transport_ok, **_: object) -> str | None:
            return transport_ok("proxy")

    from moetune.runtime.profiles import autoload
    from moetune.runtime.shapes import get_model

    got = autoload._resolve(model=get_model("qwen3-30b"), ep_size=8, nodes=2, max_tokens=256, device=None,
                            client=_Asks())  # type: ignore[arg-type]
    assert got is not None and "2 nodes" in str(got), got

    r = runner.invoke(app, ["tune", "-m", "qwen3-30b", "-t", "256", "--backend", "model", "-p",
                            "slingshot11-libfabric-a100x4", "--nodes", "2", "--trials", "3", "--db",
                            str(tmp_path / "p.db"), "--storage", f"sqlite:///{tmp_path / 's.db'}", "--json"],
                      env={"COLUMNS": "300"})
    assert r.exit_code == 0, r.output
    (row,) = json.loads(r.stdout)
    assert row["modelled"] is True and "2 nodes" in (row["runtime_refusal"] or ""), row


def test_a_multi_host_group_does_not_fall_back_to_a_proxy_policy_default(tmp_path: Path) -> None:
    """The policy-default step asks the same check: a 2-node group whose node prefers proxy:ibrc (policy default
    transport=proxy, one node's ranks only) falls back to collective; one node keeps proxy:ibrc as before."""
    import warnings

    from moetune.runtime.profiles import autoload
    from moetune.runtime.profiles.client import ProfileClient
    from moetune.runtime.shapes import get_model

    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    (run / "daemon.json").write_text(json.dumps({"fingerprint": "f" * 16, "software": "s" * 16,
                                                 "transports": ["proxy:ibrc", "collective"],
                                                 "db": str(tmp_path / "none.db")}))
    c = ProfileClient(f"ipc://{run}/daemon.sock", db_path=tmp_path / "none.db", env={"HOME": "/nonexistent"})
    got = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback warnings (no daemon, no database)
        for nodes in (1, 2):
            got[nodes] = autoload._resolve(model=get_model("qwen3-30b"), ep_size=8, nodes=nodes, max_tokens=100,
                                           device=None, client=c)
    assert (got[1].family, got[1].knobs.transport) == ("proxy:ibrc", "proxy")
    assert (got[2].family, got[2].knobs.transport) == ("collective", "collective")
    assert "spans 2 nodes" in got[2].message


def test_db_check_names_a_stored_measured_profile_no_run_can_take(tmp_path: Path) -> None:
    """A row labelled measured that the rule refuses (stored before the store refused it: an older moetune's import)
    is named by `db check`, with the rule's reason; the modelled what-if report beside it is not."""
    db = tmp_path / "p.db"
    key = ProfileKey(fingerprint="fpA", software="sw", transport_family="proxy:ibrc", ep_size=32, nodes=4, hidden=2048,
                     intermediate=768, experts=128, topk=8, dtype="bfloat16", token_bucket=256)
    knobs = Knobs(transport="proxy", fence_mode="proxy_drain")
    with Store(db) as s:
        assert s.put_profile(ProfileRecord(key=key, knobs=knobs, latency_us=50, spread_us=1,
                                           backend="model:ndr-ibrc-h100x8", provenance="preset"))[0]
        # a collective row keyed collective (keyed proxy:ibrc, autoload passes it over at EP 32: its family's world
        # rule, which the store's refuses it by too)
        assert s.put_profile(ProfileRecord(key=msgspec.structs.replace(key, token_bucket=128,
                                                                       transport_family="collective"),
                                           knobs=Knobs(transport="collective"), latency_us=50, spread_us=1,
                                           backend="local:nccl", provenance="measured", measured_on="fpA"))[0]
        assert s.check()["ok"]
    con = sqlite3.connect(db)
    with con:  # as an older moetune's import stored it: measured, transport proxy at EP 32
        pid, raw = con.execute("SELECT id, knobs FROM profiles WHERE provenance = 'measured'").fetchone()
        con.execute("UPDATE profiles SET knobs = ? WHERE id = ?", (json.dumps({**json.loads(raw), **knobs.to_dict()}),
                                                                   pid))
    con.close()
    with Store(db) as s:
        info = s.check()
    assert not info["ok"]
    assert [r["id"] for r in info["unrunnable_measured_profiles"]] == [pid], info
    assert "at most 8 ranks" in info["unrunnable_measured_profiles"][0]["error"]
    r = runner.invoke(app, ["db", "check", "--db", str(db)], env={"COLUMNS": "200"})
    assert r.exit_code == 1, r.output
    flat = " ".join(r.output.split())
    assert f"profile {pid}: labelled measured, but no run of this runtime can take it" in flat, r.output
    assert "at most 8 ranks" in flat
    # said once: the line read "no run of this runtime can take it (measured, but no run can take it: ...)"
    line = next(ln for ln in flat.split("profile ")[1:] if ln.startswith(f"{pid}:"))
    assert line.count("no run") == 1 and line.count("measured") == 1, line


def test_hosts_that_disagree_fall_back_to_a_transport_that_runs_across_them() -> None:
    """Hosts of an EP group that resolved different profiles make the group run rank 0's family's policy default
    (`autoload._group_default`). A collective profile keyed on the fabric's family proxy:ibrc gave every rank the
    proxy:ibrc policy default (transport=proxy), which serves one node's ranks only: a 2-node group must fall back to
    collective, saying why; one node keeps the proxy default."""
    from moetune.runtime.profiles import autoload
    from moetune.runtime.profiles.client import Resolution

    res = Resolution(knobs=Knobs(transport="collective"), source="daemon", profile_hash="h", status="current",
                     family="proxy:ibrc")
    got = autoload._group_default(res, 2, None, "hosts disagree", ep_size=8)
    # collective's policy default, as nvlink's and host_staged's across hosts (the built-in one before: the proxy
    # policy's own world refusal reached it first)
    assert (got.family, got.knobs.transport, got.source) == ("collective", "collective", "policy"), got
    assert got.message.startswith("hosts disagree; ") and "spans 2 nodes" in got.message, got.message
    assert not any(k.startswith("NVSHMEM") for k in got.env), got.env
    # EP 16 on 2 nodes: the rank count is said
    assert "at most 8 ranks" in autoload._group_default(res, 2, None, "hosts disagree", ep_size=16).message
    kept = autoload._group_default(res, 1, None, "test", ep_size=8)
    assert (kept.family, kept.knobs.transport) == ("proxy:ibrc", "proxy") and kept.message == "test"


def test_hosts_that_disagree_say_why_a_family_default_the_runtime_lacks_falls_back() -> None:
    """Rank 0's family ibgda has a policy default (transport=ibgda) this runtime has no transport for, so
    `_group_default` falls back to collective, and its warning says why, as it does for the world rule: it said only
    "hosts disagree", which reads as if the family's own default had been taken."""
    from moetune.runtime.profiles import autoload
    from moetune.runtime.profiles.client import Resolution

    res = Resolution(knobs=Knobs(transport="collective"), source="daemon", profile_hash="h", status="current",
                     family="ibgda")
    got = autoload._group_default(res, 1, None, "hosts disagree", ep_size=8)
    assert (got.family, got.knobs.transport, got.source) == ("collective", "collective", "default"), got
    assert got.message.startswith("hosts disagree; the policy default of ibgda: "), got.message
    assert "unknown transport 'ibgda'" in got.message, got.message


def test_a_profile_of_a_transport_the_runtime_lacks_is_a_what_if_report(tmp_path: Path) -> None:
    """IBGDA has no runtime transport (the fabric model only), so autoload passes over an ibgda profile (key family or
    knobs) as it does a proxy one beyond the runtime: the one rule (`runtime_refusal`) says so too, so the store keeps
    it modelled only (nothing here can measure it: the local backend's worker refuses an unregistered transport), and
    the tune's table and `profiles show` mark it what-if."""
    from moetune.runtime.knobs import RUNTIME_TRANSPORTS, default_knobs
    from moetune.runtime.transports.registry import registered_transports

    assert set(RUNTIME_TRANSPORTS) == set(registered_transports())  # the torch-free list is the registry's
    key = ProfileKey(fingerprint="fpA", software="sw", transport_family="ibgda", ep_size=8, nodes=1, hidden=2048,
                     intermediate=768, experts=128, topk=8, dtype="bfloat16", token_bucket=256)
    why = runtime_refusal(key, default_knobs("ibgda"))
    assert why is not None and "ibgda" in why and "no runtime transport" in why, why
    assert runtime_refusal(key, Knobs(transport="collective")) is not None  # autoload asks the key's family too
    assert runtime_refusal(msgspec.structs.replace(key, transport_family="collective"),
                           Knobs(transport="collective")) is None
    s = Store(tmp_path / "p.db")
    with pytest.raises(FieldError, match="no runtime transport"):
        s.put_profile(ProfileRecord(key=key, knobs=default_knobs("ibgda"), latency_us=50, spread_us=1,
                                    backend="local:nccl", provenance="measured", measured_on="fpA"))
    s.close()

    args = ["tune", "-m", "qwen3-30b", "-t", "256", "--backend", "model", "-p", "ndr-ibgda-h100x8", "--trials", "3",
            "--db", str(tmp_path / "m.db"), "--storage", f"sqlite:///{tmp_path / 's.db'}"]
    r = runner.invoke(app, args, env={"COLUMNS": "300"})
    assert r.exit_code == 0, r.output
    flat = " ".join(r.output.split())
    assert "new (what-if)" in flat and "no runtime transport" in flat, r.output
    with sqlite3.connect(tmp_path / "m.db") as db:
        ((pid, prov),) = db.execute("SELECT id, provenance FROM profiles").fetchall()
    assert prov == "preset"
    show = runner.invoke(app, ["profiles", "show", str(pid), "--db", str(tmp_path / "m.db")], env={"COLUMNS": "300"})
    assert show.exit_code == 0, show.output
    assert "what-if only: the runtime cannot run it" in " ".join(show.output.split()), show.output
    r = runner.invoke(app, [*args, "--json"], env={"COLUMNS": "300"})
    assert r.exit_code == 0, r.output
    (row,) = json.loads(r.stdout)
    assert row["modelled"] is True and "no runtime transport" in (row["runtime_refusal"] or ""), row


def test_a_measuring_backend_does_not_take_a_family_the_runtime_has_no_transport_for() -> None:
    """The store refuses a measured ibgda profile (`runtime_refusal`), so a local tune or bring-up must not plan the
    family at all: every real trial fails (the worker refuses an unregistered transport), and a bench that answered
    (the bring-up tests' fake) ended the bring-up on the store's FieldError. `supports` says so, and `tune` skips the
    family ("backend local cannot measure it") as it skips one the backend cannot run."""
    from moetune.tuner.search.local_backend import LocalBackend

    be = LocalBackend(world=2, comm_backend="gloo", command=["true"])
    assert not be.supports("ibgda")
    assert all(be.supports(f) for f in ("collective", "host_staged", "nvlink", "proxy:ibrc", "proxy:libfabric/cxi",
                                        "megakernel"))
    # asked for by name on a node that has it (a DGX H100 capture: mlx5 + GPUDirect RDMA): refused, saying why
    from moetune.runtime.shapes import MODELS
    from moetune.tuner.fabric.discovery import discover
    from moetune.tuner.search.tune import check_tune

    facts = discover(Path(__file__).resolve().parent / "captures" / "dgx-h100")
    assert "ibgda" in [t.name for t in facts.transports]
    with pytest.raises(ValueError, match=r"no transport family to tune \(found: ibgda; backend local:gloo; it cannot "
                                         r"measure ibgda\)"):
        check_tune(facts, models=[MODELS["qwen3-30b"]], backend=be, ep_size=2, families=["ibgda"])


def test_the_key_s_family_is_judged_by_the_world_rule_as_autoload_judges_it() -> None:
    """Autoload asks its transport check (world rule included) of the key's family and of the knobs' transport
    (client._transport_problem); runtime_refusal asked the world rule of the knobs' only, so a row keyed nvlink at EP
    16 whose knobs name collective (an import or hand edit: put_profile does not compare the two) was passed over by
    autoload and reported as runnable (not what-if; `db check` silent on it labelled measured)."""
    key = ProfileKey(fingerprint="fpA", software="sw", transport_family="nvlink", ep_size=16, nodes=1,
                     hidden=2048, intermediate=768, experts=128, topk=8, dtype="bfloat16", token_bucket=256)
    knobs = Knobs(transport="collective")
    assert transport_world_problem("nvlink", 16) is not None  # autoload's check of the key's family
    why = runtime_refusal(key, knobs)
    assert why is not None and "transport=nvlink serves at most 8 ranks" in why, why
    assert runtime_refusal(msgspec.structs.replace(key, transport_family="collective"), knobs) is None
    assert runtime_refusal(msgspec.structs.replace(key, ep_size=8), knobs) is None


def _host_staged_preset(tmp_path: Path) -> Path:
    """A fabric model whose family is host_staged and that has a network (a user's preset; the shipped host_staged
    presets, pcie4-consumer-4090x4 and nvlink-h200x2, are one box: max_nodes = 1): the ndr-ibrc-h100x8 numbers, whose
    [pcie] and [nic] the host_staged phase reads, with host_staged its family."""
    from moetune.tuner.fabric_model.presets import load_preset

    base = load_preset("ndr-ibrc-h100x8")
    text = base.to_toml().replace('family = "proxy:ibrc"', 'family = "host_staged"', 1)
    text = text.replace('transports = ["proxy", "collective", "nvlink"]',
                        'transports = ["proxy", "collective", "nvlink", "host_staged"]', 1)
    path = tmp_path / "staged-across-nodes.toml"
    path.write_text(text.replace('name = "ndr-ibrc-h100x8"', 'name = "staged-across-nodes"', 1))
    return path


def test_host_staged_across_nodes_is_beyond_the_runtime_too(tmp_path: Path) -> None:
    """The fabric model predicts host_staged across nodes (its NIC bytes), but the runtime's host_staged stages
    through one host's /dev/shm file: a rank on another host cannot map it. The one rule (`group_world_problem`)
    says so for the store, the tune's report and autoload, as it does for nvlink and proxy; the model's number is
    still reported, labelled modelled and what-if."""
    from moetune.runtime.knobs import group_world_problem

    why = group_world_problem("host_staged", 8, nodes=2)
    assert why is not None and "transport=host_staged serves the ranks of one node" in why and "2 nodes" in why, why
    assert group_world_problem("host_staged", 8, nodes=1) is None
    assert group_world_problem("host_staged", 64, nodes=1) is None  # no rank limit: one host's ranks, any number
    assert group_world_problem("collective", 16, nodes=2) is None
    assert group_world_problem("proxy", 8, nodes=2) == one_sided_world_problem("proxy", 8, nodes=2)
    assert transport_world_problem("host_staged", 8, nodes=2) == f"knob transport: {why}"
    assert transport_world_problem("host_staged", 8, nodes=1) is None

    key = ProfileKey(fingerprint="fpA", software="sw", transport_family="host_staged", ep_size=8, nodes=2,
                     hidden=2048, intermediate=768, experts=128, topk=8, dtype="bfloat16", token_bucket=256)
    knobs = Knobs(transport="host_staged")
    assert runtime_refusal(key, knobs) == why
    assert runtime_refusal(msgspec.structs.replace(key, nodes=1), knobs) is None
    with Store(tmp_path / "p.db") as s, pytest.raises(FieldError, match="host_staged serves the ranks of one node"):
        s.put_profile(ProfileRecord(key=key, knobs=knobs, latency_us=50, spread_us=1, backend="local:nccl",
                                    provenance="measured", measured_on="fpA"))

    # autoload gives its check the group's node count: a 2-node group passes a host_staged profile over
    class _Asks:
        def resolve(self, *, transport_ok, **_: object) -> str | None:
            return transport_ok("host_staged")

    from moetune.runtime.profiles import autoload
    from moetune.runtime.shapes import get_model

    got = autoload._resolve(model=get_model("qwen3-30b"), ep_size=8, nodes=2, max_tokens=256, device=None,
                            client=_Asks())  # type: ignore[arg-type]
    assert got is not None and "host_staged serves the ranks of one node" in str(got), got

    preset = _host_staged_preset(tmp_path)
    rows = {}
    for nodes in (1, 2):
        r = runner.invoke(app, ["tune", "-m", "qwen3-30b", "-t", "256", "--backend", "model", "-p", str(preset),
                                "--nodes", str(nodes), "--trials", "3", "--db", str(tmp_path / f"t{nodes}.db"),
                                "--storage", f"sqlite:///{tmp_path / f's{nodes}.db'}", "--json"],
                          env={"COLUMNS": "300"})
        assert r.exit_code == 0, r.output
        (rows[nodes],) = json.loads(r.stdout)
    assert rows[1]["runtime_refusal"] is None, rows[1]
    assert rows[2]["modelled"] is True and "spans 2 nodes" in (rows[2]["runtime_refusal"] or ""), rows[2]
    assert rows[2]["best_us"] > 0 and rows[2]["stored"], rows[2]  # the model's number is kept: a what-if report
