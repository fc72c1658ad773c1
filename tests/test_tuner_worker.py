"""The persistent bench worker: many cases through one world, errors, hangs, crashes, one worker per env."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

import pytest

from moetune.runtime.knobs import Knobs
from moetune.runtime.shapes import get_model
from moetune.tuner.search.backends import TuneWorkload
from moetune.tuner.search.local_backend import LocalBackend

MODEL = "custom:64,32,8,2"
WL = TuneWorkload(model=get_model(MODEL), tokens=16, nodes=1, gpus_per_node=2)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie counts as dead
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _group_pids(pgid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().split(")")[-1].split()
            except (FileNotFoundError, ProcessLookupError):
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                out.append(int(d))
    return out


def _wait_gone(pids: list[int], s: float = 10.0) -> bool:
    deadline = time.monotonic() + s
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(_alive(p) for p in pids)


class HookedBackend(LocalBackend):
    """A LocalBackend whose next cases carry test hooks (honoured only with MOETUNE_TEST_HOOKS=1)."""

    hooks: dict[str, Any] = {}  # noqa: RUF012

    def case(self, knobs: Knobs, workload: TuneWorkload) -> dict[str, Any]:
        return {**super().case(knobs, workload), **self.hooks}


def _cli_json(*args: str) -> dict[str, Any]:
    p = subprocess.run([sys.executable, "-c", "from moetune.tuner.cli import main; main()", "bench", "ep", *args],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_worker_protocol_matches_bench_ep_json() -> None:
    cases = [
        {"id": 1, "model": MODEL, "tokens": 16, "iters": 3, "warmup": 1},
        {"id": 2, "model": MODEL, "tokens": 16, "knobs": "bogus=1"},  # invalid knobs: an error line
        "not json",
        {"id": 3, "model": MODEL, "tokens": 8, "iters": 2, "warmup": 1, "verify": True,
         "knobs": {"pipeline_depth": 2}, "routing": "zipf:1.2"},
        {"id": 4, "model": MODEL, "tokens": 16, "iters": 2, "warmup": 0, "layer": False, "impl": "plain"},
        {"id": 5, "model": "custom:64,32,7,2", "tokens": 16},  # 7 experts over 2 ranks
    ]
    stdin = "\n".join(c if isinstance(c, str) else json.dumps(c) for c in cases) + "\n"
    p = subprocess.run([sys.executable, "-c", "from moetune.tuner.cli import main; main()", "bench", "ep", "--serve",
                        "--world", "2", "--backend", "gloo", "--timeout", "30"],
                       input=stdin, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr  # EOF ends it cleanly
    lines = [json.loads(ln) for ln in p.stdout.strip().splitlines()]
    assert lines[0]["ready"] is True and lines[0]["world"] == 2
    by_id = {ln.get("id"): ln for ln in lines[1:]}
    assert len(lines) == 1 + len(cases)
    assert "unknown knob 'bogus'" in by_id[2]["error"]
    assert "not a JSON case" in by_id[None]["error"]
    assert "do not divide evenly over an EP group of" in by_id[5]["error"]
    ref = _cli_json("--world", "2", "--backend", "gloo", "--model", MODEL, "--tokens", "16", "--iters", "3",
                    "--warmup", "1", "--json")
    # the CLI's report is a result file and carries its stamp ("meta": SHA, hardware, command); the worker's answers
    # are a trial's numbers (the tuner records what measured them), stamped by no git call per trial
    assert "meta" in ref and set(by_id[1]) == (set(ref) - {"meta"}) | {"id"}
    for key in ("dispatch_us", "combine_us", "roundtrip_us", "layer_us"):
        assert set(by_id[1][key]) == set(ref[key]) == {"median", "p10", "p90"}
    assert by_id[1]["knobs"] == ref["knobs"] and by_id[1]["world"] == 2 and by_id[1]["tokens"] == 16
    assert by_id[3]["verify_ok"] is True and by_id[3]["knobs"]["pipeline_depth"] == 2 and by_id[3]["tokens"] == 8
    assert by_id[4]["impl"] == "plain" and by_id[4]["layer_us"] is None


def test_persistent_backend_reuses_survives_hang_and_crash(monkeypatch) -> None:
    monkeypatch.setenv("MOETUNE_TEST_HOOKS", "1")
    be = HookedBackend(world=2, comm_backend="gloo", repeats=2, timeout_s=60, iters=3, metric="comm")
    assert be.persistent
    try:
        k = Knobs()
        m = be.evaluate(k, WL)
        assert m.ok and len(m.samples) == 2 and m.median_us > 0, m.error
        (w1,) = be._workers.values()
        pid1 = w1.proc.pid
        assert be.evaluate(k.replace(pipeline_depth=2), WL).ok
        assert next(iter(be._workers.values())).proc.pid == pid1  # the same world served both

        # a case the worker rejects, and an exception raised on every rank: error lines, the worker goes on
        be.hooks = {"layout": "zigzag"}
        bad = be.evaluate(k, WL)
        assert not bad.ok and "bench error" in (bad.error or "") and "layout must be" in bad.error
        be.hooks = {"_test_raise": "boom on every rank"}
        raised = be.evaluate(k, WL)
        assert not raised.ok and "RuntimeError: boom on every rank" in (raised.error or "")
        be.hooks = {}
        assert be.evaluate(k, WL).ok
        assert next(iter(be._workers.values())).proc.pid == pid1

        # a hung case: killed at the timeout with its whole group, recorded failed
        ranks = [p for p in _group_pids(pid1) if p != pid1]
        assert len(ranks) >= 2
        be.hooks, be.timeout_s = {"_test_sleep_s": 60}, 2.0
        t0 = time.monotonic()
        hung = be.evaluate(k, WL)
        assert time.monotonic() - t0 < 10
        assert not hung.ok and "timed out after 2 s" in (hung.error or "") and "process group killed" in hung.error
        assert _wait_gone([pid1, *ranks]), "the hung worker or one of its ranks survived"
        assert not be._workers

        # the next run gets a fresh worker
        be.hooks, be.timeout_s = {}, 60
        again = be.evaluate(k, WL)
        assert again.ok, again.error
        (w2,) = be._workers.values()
        assert w2.proc.pid != pid1

        # a rank that dies: the trial fails with the worker's exit status; the next one works again
        be.hooks = {"_test_exit": 5}
        crash = be.evaluate(k, WL)
        assert not crash.ok and "exit status 3" in (crash.error or "") and "exited with code 5" in crash.error
        be.hooks = {}
        assert be.evaluate(k, WL).ok
        (w3,) = be._workers.values()
        assert w3.proc.pid not in (pid1, w2.proc.pid)
    finally:
        be.close()
    assert not be._workers and _wait_gone([w3.proc.pid])


def test_one_worker_per_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    # host_staged and collective need the same (empty) environment now (launcher_env); a stand-in variable
    # makes two environments, so two workers
    from moetune.tuner.search import local_backend

    monkeypatch.setattr(local_backend, "knob_environment",
                        lambda k, fam, nodes=1: {"STANDIN_KNOB_ENV": "1"} if k.transport == "host_staged" else {})
    be = LocalBackend(world=2, comm_backend="gloo", repeats=1, timeout_s=60, iters=2, metric="comm",
                      family="host_staged")
    try:
        assert be.evaluate(Knobs(transport="host_staged"), WL).ok
        be.family = "collective"
        assert be.evaluate(Knobs(), WL).ok
        assert len(be._workers) == 2
        envs = {}
        for key, w in be._workers.items():
            with open(f"/proc/{w.proc.pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            envs[key] = env.get(b"STANDIN_KNOB_ENV")
        assert envs == {(("STANDIN_KNOB_ENV", "1"),): b"1", (): None}
        pids = [w.proc.pid for w in be._workers.values()]
    finally:
        be.close()
    assert _wait_gone(pids)


def test_subprocess_mode_still_available() -> None:
    assert not LocalBackend(command=["true"]).persistent
    assert not LocalBackend(persistent=False).persistent
    assert not LocalBackend(extra_args=["--seed", "1"]).persistent
    with pytest.raises(ValueError):
        LocalBackend(persistent=True, extra_args=["--seed", "1"])
