"""The daemon's caches of encoded replies are bounded and evict the least recently used entry, not keep their first
keys for good: otherwise one reader asking list_profiles with limit=1..64 fills the 64 list slots, after which every
other list request is read and encoded again on the one list worker (whose queue then answers `busy`). A list
request's key is also the page it gets, not its spelling (limits past the page size or the profile count are one)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.runtime.profile_record import ProfileKey
from moetune.runtime.profiles.client import ProfileClient
from moetune.tuner.daemon.index import LIST_CACHE_LIMIT, LIST_PAGE_MAX, ProfileIndex, ReplyCache
from moetune.tuner.daemon.server import Daemon

pytestmark = pytest.mark.timeout(60)


def test_the_reply_cache_evicts_the_least_recently_used() -> None:
    c = ReplyCache(3)
    for k in "abc":
        c.put(k, k.upper())
    assert c.get("a") == "A"  # used: now the newest
    c.put("d", "D")
    assert len(c) == 3 and "b" not in c and c.get("a") == "A" and c.get("d") == "D"


def test_a_list_key_is_the_page_not_the_limit_spelled() -> None:
    facts = F.FakeFacts({"gpu_model": "H200"})
    recs = [F.make_record(ProfileKey(
        fingerprint=facts.fingerprint, software="sw", transport_family="nvlink", ep_size=2, nodes=1, hidden=2048,
        intermediate=768, experts=128, topk=8, dtype="bfloat16", token_bucket=b)) for b in (16, 64, 256)]
    idx = ProfileIndex(recs, version=1, facts=facts, stale=[])
    assert idx.list_key("current", None, 3) == idx.list_key("current", None, 64) == idx.list_key("current", None, 10000)
    assert idx.list_key("current", None, 2) != idx.list_key("current", None, 3)
    assert idx.list_key("current", "other", 5) == idx.list_key("current", "other", 500)  # nothing to list: one page
    assert idx.list_key("superseded", None, LIST_PAGE_MAX) == idx.list_key("superseded", None, 10000)
    assert idx.list_key("superseded", None, 5) != idx.list_key("superseded", None, 6)  # the history is in the store


def test_a_reader_filling_the_list_cache_does_not_keep_others_out_of_it(tmp_path: Path) -> None:
    facts = F.FakeFacts({"gpu_model": "H200"})
    store = F.open_store(tmp_path / "moetune.db")
    F.seed_profiles(store, facts)
    endpoint = f"ipc://{tmp_path}/run/d.sock"
    d = Daemon(store=store, endpoint=endpoint, discover=lambda: facts, rediscover_interval_s=0).start(background=True)
    built: list[Any] = []
    real = d._list_page
    d._list_page = lambda req: built.append((req.status, req.limit)) or real(req)  # type: ignore[method-assign]
    c = ProfileClient(endpoint, timeout_ms=5000)
    try:
        for limit in range(1, LIST_CACHE_LIMIT + 1):  # the history's pages are all distinct
            c.list_profiles(status="superseded", limit=limit)
        assert len(built) == LIST_CACHE_LIMIT
        for _ in range(3):  # another client's page: built once, then served from the cache
            assert len(c.list_profiles(status="stale", limit=100).profiles) == 0
            assert len(c.list_profiles(status="current", limit=100).profiles) == 3
        assert built[LIST_CACHE_LIMIT:] == [("stale", 100), ("current", 100)], built[LIST_CACHE_LIMIT:]
        c.list_profiles(status="current", limit=1000)  # the same page, spelled otherwise
        assert len(built) == LIST_CACHE_LIMIT + 2
        c.list_profiles(status="superseded", limit=1)  # the least recently used went to make room
        assert built[-1] == ("superseded", 1)
    finally:
        c.close()
        d.stop()
