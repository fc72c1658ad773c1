"""`moetune query --family megakernel --tokens S` answers the profile the one-GPU layer runs for S: the layer installs
one profile per token bucket, looked up for the bucket S falls in (MegakernelEngine.resolve, and since eb1dd36f the
construction bucket too), not for S itself. With stored buckets that leave gaps, S may be nearer another stored bucket
than its bucket is (S=1500 is nearest 1024; its bucket 2048 ties 1024 and 4096, and ties go to the larger)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from moetune.runtime.knobs import Knobs
from moetune.runtime.profile_record import nearest_bucket
from moetune.tuner.cli import app

STORED = {128: Knobs(engine="megakernel", mk_bm=16), 1024: Knobs(engine="megakernel", mk_bm=64),
          4096: Knobs(engine="megakernel", mk_bm=128)}  # `moetune profile`'s default sizes


def test_query_names_the_profile_the_layer_runs_for_that_s(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from moetune.runtime.profiles import client

    def resolve(self: Any, *, tokens: int, **kw: Any) -> client.Resolution:
        knobs = STORED[nearest_bucket(tokens, list(STORED))]  # the stored bucket nearest to what is asked (pick_profile)
        return client.Resolution(knobs=knobs, source="database", profile_hash="0" * 16, status="current",
                                 family=kw["transport_family"])

    monkeypatch.setattr(client.ProfileClient, "resolve", resolve)
    r = CliRunner().invoke(app, ["query", "--model", "qwen3-30b", "--ep", "1", "--tokens", "1500", "--family",
                                 "megakernel", "--socket",
                                 f"ipc://{tmp_path}/none.sock", "--timeout-ms", "100", "--json"])
    assert r.exit_code == 0, r.output
    got = json.loads(r.stdout.strip().splitlines()[-1])["knobs"]["mk_bm"]
    runs = STORED[nearest_bucket(nearest_bucket(1500), list(STORED))]  # what the layer looks up and runs for S=1500
    assert got == runs.mk_bm == 128, got
