"""host_staged's staging layout and cutting, and its fallback, on the CPU box (the copy-engine path itself
is tested on GPUs in test_runtime_gpu.py)."""

from __future__ import annotations

import ctypes
import os
import random
from pathlib import Path
from types import SimpleNamespace

import pytest

from moetune.runtime.knobs import KnobError, Knobs
from moetune.runtime.testing.launch import launch
from moetune.runtime.transports import host_staged as hs


def _bare(world: int, rank: int, lanes: int, slot: int, ring: int = 4) -> hs.HostStagedTransport:
    """A transport with the layout fields set and no staging memory (enough for the offset arithmetic)."""
    t = hs.HostStagedTransport.__new__(hs.HostStagedTransport)
    t.world, t.rank, t.lanes, t.slot_bytes, t.ring = world, rank, lanes, slot, ring
    t._sent = [[0] * world for _ in range(lanes)]
    t._recvd = [[0] * world for _ in range(lanes)]
    n_slots = lanes * world * (world - 1) * ring
    t._data_base = -(-8 * n_slots // 4096) * 4096
    return t


@pytest.mark.parametrize("world,lanes,ring", [(2, 1, 2), (2, 4, 2), (3, 2, 2), (8, 2, 2), (2, 2, 4), (3, 1, 16)])
def test_every_slot_has_its_own_data_and_flags(world: int, lanes: int, ring: int) -> None:
    slot = 8192
    t = _bare(world, 0, lanes, slot, ring)
    seen_data, seen_flags = set(), set()
    for lane in range(lanes):
        for src in range(world):
            for dst in range(world):
                if src == dst:
                    continue
                for s in range(ring):
                    data, flag = t._offsets(lane, src, dst, s)
                    assert data % 4096 == 0 and data >= t._data_base
                    assert flag % 8 == 0 and flag + 8 <= t._data_base
                    seen_data.add(data)
                    seen_flags.add(flag)
    n = lanes * world * (world - 1) * ring
    assert len(seen_data) == n and len(seen_flags) == n
    assert max(seen_data) + slot == t._data_base + n * slot  # the last slot ends where the memory ends


def test_pieces_cover_the_block_and_fit_the_slots() -> None:
    rng = random.Random(5)
    for _ in range(3000):
        slot = rng.randint(1, 3000) * 4096
        n = rng.randint(0, 30 * slot + 7)
        p = hs.piece_sizes(n, slot)
        assert sum(p) == n and all(0 < x <= slot for x in p)
    assert hs.piece_sizes(100, 4096) == [100]  # a block that fits goes whole (store-and-forward)
    assert hs.piece_sizes(3 * 4096 + 5, 4096) == [4096, 4096, 4096, 5]
    assert hs.piece_sizes(0, 4096) == []


@pytest.mark.parametrize("ring", [2, 3])
def test_sender_and_receiver_cut_a_block_alike(ring: int) -> None:
    """Rank 0's send pieces to rank 1 and rank 1's receive pieces from rank 0 use the same slots and flags
    in the same order, call after call (the ring wraps)."""
    slot = 64 * 1024
    a, b = _bare(2, 0, 1, slot, ring), _bare(2, 1, 1, slot, ring)
    flags = []
    for n in (0, 100, slot, 3 * slot + 5, 1 << 20, 7):
        out = a._pieces(0, 0, 1, 1000, n, a._sent)
        inc = b._pieces(0, 0, 1, 9000, n, b._recvd)
        assert [(d, sz, f) for d, _p, sz, f, _peer in out] == [(d, sz, f) for d, _p, sz, f, _peer in inc]
        assert [p[4] for p in out] == [1] * len(out) and [p[4] for p in inc] == [0] * len(inc)
        assert [p[1] - 1000 for p in out] == [p[1] - 9000 for p in inc] == [i * slot for i in range(len(out))]
        flags += [p[3] for p in out]
    # the k-th use of a (lane, pair) ring takes slot k mod ring: the slots take turns
    uses = a._sent[0][1]
    assert uses == b._recvd[0][0] == len(flags) and uses > 2 * ring
    assert flags == [a._offsets(0, 0, 1, k % ring)[1] for k in range(uses)]
    assert len(set(flags)) == ring


def test_staging_slots_are_a_knob() -> None:
    assert Knobs(transport="host_staged").staging_slots == 4
    assert Knobs.parse("transport=host_staged,staging_slots=3").staging_slots == 3
    for bad in ("1", "17", "four", "2.5"):
        with pytest.raises(KnobError, match="staging_slots"):
            Knobs.parse(f"transport=host_staged,staging_slots={bad}")
    with pytest.raises(KnobError, match="staging_slots"):
        Knobs(transport="collective", staging_slots=8)  # no staging slots there


def test_wait_mode_is_a_knob() -> None:
    assert hs.wait_mode_code(Knobs(transport="host_staged")) == 1  # cuStreamWaitValue64 with the watchdog
    assert hs.wait_mode_code(Knobs(transport="host_staged", wait_mode="kernel")) == 0
    with pytest.raises(KnobError, match="wait_mode"):
        Knobs.parse("transport=host_staged,wait_mode=spin")


def test_retired_variables_are_an_error_not_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    from moetune.runtime.options import RuntimeOptionError, RuntimeOptions

    monkeypatch.setenv("MOETUNE_HS_SLOTS", "8")
    with pytest.raises(RuntimeOptionError, match=r"MOETUNE_HS_SLOTS.*staging_slots"):
        RuntimeOptions.resolve(env={"MOETUNE_HS_SLOTS": "8"})


def test_chunk_tokens_sizes_the_staging_message(monkeypatch: pytest.MonkeyPatch) -> None:
    t = _bare(2, 0, 1, 0)
    t.native, t._mm, t.knobs = True, None, Knobs(transport="host_staged", chunk_tokens=512)
    monkeypatch.setattr(t, "_setup", lambda: None)
    t.stage_capacity(4096, 4192)
    assert t.slot_bytes == 512 * 4192  # a page multiple already
    t.knobs = Knobs(transport="host_staged")
    t.stage_capacity(4096, 4192)  # chunk_tokens=0: one block per slot (store-and-forward)
    assert t.slot_bytes == 4096 * 4192


def _gloo_case(rank: int, world: int) -> dict:
    import torch

    from moetune.runtime import EPBuffer, get_model
    from moetune.runtime.routing import generate_routing

    model = get_model("custom:64,32,8,2,float32")
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(rank))
    idx, w = generate_routing(40, 8, 2, routing="uniform", seed=rank)
    outs = []
    for tr in ("collective", "host_staged"):
        buf = EPBuffer(knobs=Knobs.parse(f"transport={tr},pipeline_depth=2,chunk_tokens=8"), model=model,
                       max_tokens=40, dense=False)
        recv, meta, h = buf.dispatch(x, idx, w)
        outs.append(buf.combine(recv * meta.weights.sum(1, keepdim=True), h))
        native = getattr(buf.transport, "native", None), getattr(buf.transport, "native_reason", "")
        buf.close()
    return {"equal": bool(torch.equal(outs[0], outs[1])), "native": native}


@pytest.mark.timeout(120)
def test_without_cuda_it_is_the_collective() -> None:
    """On CPU (gloo) host_staged runs the collective's path and says why."""
    for rep in launch(_gloo_case, 2, timeout_s=60):
        assert rep["equal"]
        assert rep["native"][0] is False and "CUDA" in rep["native"][1]


def _hosts_case(rank: int, world: int, layouts: list[list[str]]) -> list[str]:
    """Build host_staged on a gloo group whose ranks tell their host as each of `layouts` says in turn (the host
    count is the real all-gather); what each build raised, or "built". One group for every layout: each spawn of
    ranks costs seconds on a 2-core machine."""
    from moetune.runtime import hosts

    out = []
    for hosts_of in layouts:
        hosts.host_identity = lambda hosts_of=hosts_of: hosts_of[rank]  # type: ignore[misc]
        try:
            t = hs.HostStagedTransport(None, Knobs(transport="host_staged"), "cpu")
        except KnobError as e:
            out.append(f"KnobError: {e}")
            continue
        t.close()
        out.append("built")
    return out


@pytest.mark.timeout(120)
def test_a_group_across_hosts_is_refused_with_the_rule_s_words() -> None:
    """The staging memory is one host's /dev/shm file: a rank on another host could not map it (the copy-engine path
    failed in its setup, "the staging memory could not be set up", and NCCL's staging ran where the library was off).
    The transport counts the group's hosts when it is built and raises `group_world_problem`'s words on every rank,
    the words the store and autoload say of a host_staged profile of 2 nodes."""
    from moetune.runtime.knobs import group_world_problem

    # refused across hosts, then built on one host by the same ranks (the refusal left the group usable)
    got = launch(_hosts_case, 2, args=([["host:a", "host:b"], ["host:a", "host:a"]],), timeout_s=60)
    why = group_world_problem("host_staged", 2, "HostStagedTransport: ", nodes=2)
    assert got == [[f"KnobError: knob transport: {why}", "built"]] * 2, got


def test_wrong_knobs_are_refused_before_any_collective(monkeypatch: pytest.MonkeyPatch) -> None:
    """HostStagedTransport loaded the library and joined an all-reduce (which ranks take the native path) before the
    base class checked the knobs: a rank given another transport's knobs was refused only after that collective,
    its peers left waiting in the next one. The check now comes first. A CUDA world of 2 is pretended (this box
    has neither): every collective or library load the constructor would reach is recorded instead of run."""
    import torch.distributed as dist

    from moetune.runtime import csrc_build

    reached: list[str] = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(csrc_build, "availability", lambda: (True, ""))
    monkeypatch.setattr(csrc_build, "load", lambda: reached.append("load") or object())
    monkeypatch.setattr(hs, "all_ok", lambda ok, group, device: reached.append("all_ok") or ok)
    for knobs in (Knobs(transport="collective"), Knobs(transport="nvlink")):
        with pytest.raises(KnobError, match="needs transport=host_staged knobs"):
            hs.HostStagedTransport(None, knobs, "cuda:0")
    with pytest.raises(TypeError, match="group must be"):
        hs.HostStagedTransport("not a group", Knobs(transport="host_staged"), "cuda:0")  # type: ignore[arg-type]
    assert reached == []


def _rank0_setup(monkeypatch: pytest.MonkeyPatch, shm: Path, *, create_rc: int = 0) -> hs.HostStagedTransport:
    """Rank 0 of 2 ready to run _setup on the CPU box: /dev/shm is `shm`, the library a stand-in whose
    mt_hs_create returns `create_rc`, the broadcast and all_ok pass their value through."""
    import torch

    from moetune.runtime.options import RuntimeOptions

    t = _bare(2, 0, 1, 4096, 2)
    t.device, t.group, t.knobs, t.options = torch.device("cpu"), None, Knobs(transport="host_staged"), RuntimeOptions.resolve()
    t._mm, t._anchor, t._h = None, None, ctypes.c_void_p()
    t.lib = SimpleNamespace(mt_hs_create=lambda *a: create_rc, mt_last_error=lambda: b"stand-in failure",
                            mt_hs_destroy=lambda h: 0)
    monkeypatch.setattr(hs, "_SHM_DIR", str(shm))
    monkeypatch.setattr(t, "_broadcast_name", lambda name: name)
    monkeypatch.setattr(hs, "all_ok", lambda ok, group, device: ok)
    return t


def _fail(*_a: object) -> None:
    raise OSError(28, "No space left on device")


@pytest.mark.parametrize("where", ["ftruncate", "broadcast", "all_ok", "create", "none"])
def test_rank0_unlinks_the_staging_file_whatever_fails(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                       where: str) -> None:
    """The file rank 0 made in /dev/shm was left there when ftruncate failed (the handler cleared the name the
    unlink used) or when the broadcast of its name raised: every failure after creation now unlinks it, and
    only it (another process's file beside it stays)."""
    shm = tmp_path / "shm"
    shm.mkdir()
    other = shm / "moetune-hs-1-someone-else"
    other.write_bytes(b"")
    t = _rank0_setup(monkeypatch, shm, create_rc=1 if where == "create" else 0)
    if where == "ftruncate":
        monkeypatch.setattr(os, "ftruncate", _fail)
    elif where == "broadcast":
        monkeypatch.setattr(t, "_broadcast_name", lambda name: (_ for _ in ()).throw(RuntimeError("peer gone")))
    elif where == "all_ok":
        monkeypatch.setattr(hs, "all_ok", lambda ok, group, device: (_ for _ in ()).throw(RuntimeError("peer gone")))
    if where == "none":
        t._setup()
        assert t._mm is not None and len(t._mm) > 0
        t._release()
    else:
        with pytest.raises((hs.HostStagedError, RuntimeError)):
            t._setup()
    assert sorted(p.name for p in shm.iterdir()) == [other.name]


class _PostLib:
    """The library's calls _move reaches, recorded; mt_hs_post fails while `fail` is set."""

    def __init__(self) -> None:
        self.posts: list[list[int]] = []  # the flag offsets of each post's send pieces
        self.fail = False

    def mt_hs_post(self, h, lane, stream, n_out, ops_out, n_in, ops_in, ld, ls, nb, ticket) -> int:
        self.posts.append([ops_out[hs._OP_WORDS * j + 3] for j in range(n_out)])
        return 7 if self.fail else 0

    def mt_hs_error(self, h, words) -> int:
        return 0

    def mt_hs_wait(self, *a) -> int:
        return 0

    def mt_last_error(self) -> bytes:
        return b"cudaMemcpyAsync failed (stand-in)"


def _posting(monkeypatch: pytest.MonkeyPatch) -> tuple[hs.HostStagedTransport, _PostLib]:
    """Rank 0 of 2 with staging memory 'set up' and a stand-in library (no CUDA: the stream is faked)."""
    import torch

    t = _bare(2, 0, 1, 4096, 2)
    lib = _PostLib()
    t.lib, t._h, t._mm, t._broken, t.device = lib, ctypes.c_void_p(1), object(), "", torch.device("cpu")
    t._held_after_failure = []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: SimpleNamespace(cuda_stream=0))
    return t, lib


def test_a_failed_post_breaks_the_transport(monkeypatch: pytest.MonkeyPatch) -> None:
    """mt_hs_post stages piece by piece, so a failure may leave some pieces queued: the ring counters (moved
    before the post) no longer match the peer's whichever way they are set. Every later call raises and posts
    nothing: raising once would let the next exchange post on the out-of-step rings."""
    import torch

    t, lib = _posting(monkeypatch)
    work = t._move(0, [(1, 1 << 20, 3 * 4096)], [], None)
    lib.fail = True
    tensors = (torch.zeros(4), torch.zeros(4))
    with pytest.raises(hs.HostStagedError, match="cudaMemcpyAsync failed"):
        t._move(0, [(1, 1 << 20, 4096)], [], None, keep=tensors)
    # the pieces it queued may still copy into them: kept (not handed back to the allocator) until close
    assert t._held_after_failure == [tensors]
    lib.fail = False
    for _ in range(2):
        with pytest.raises(hs.HostStagedError, match=r"earlier exchange failed while being posted.*cannot be used again"):
            t._move(0, [(1, 1 << 20, 4096)], [], None)
    with pytest.raises(hs.HostStagedError, match="cannot be used again"):
        work.wait()  # an exchange posted before the failure: its wait says so too
    assert len(lib.posts) == 2


def test_a_failure_before_the_post_leaves_the_rings_in_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure before the library was called posted nothing: the ring counters go back, and the next
    exchange takes the slots the peer expects."""
    import torch

    t, lib = _posting(monkeypatch)
    peer = _bare(2, 1, 1, 4096, 2)
    t._move(0, [(1, 1 << 20, 4096)], [], None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: (_ for _ in ()).throw(RuntimeError("no CUDA")))
    with pytest.raises(RuntimeError, match="no CUDA"):
        t._move(0, [(1, 1 << 20, 3 * 4096)], [], None)
    assert t._sent[0][1] == 1 and not t._broken
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: SimpleNamespace(cuda_stream=0))
    t._move(0, [(1, 1 << 20, 4096)], [], None)
    expect = [[p[3] for p in peer._pieces(0, 0, 1, 0, 4096, peer._recvd)] for _ in range(2)]
    assert lib.posts == expect and expect[0] != expect[1]


# -- combine_lanes=auto follows the path that runs, not the class's prediction ------------------------------------


def test_a_fallen_back_transport_keeps_combine_lanes_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """With combine_lanes=auto the EP buffer asked the class (`combine_shares_lanes`: CUDA, hs_native and the
    library buildable) before the transport was built; a transport that then fell back to NCCL's staging (the
    library failed to load, another rank lacks it, one rank) still had combine queued on the dispatch
    communicators, which that path does worse with. Here the class predicts the copy-engine path, and on CPU the
    transport falls back: combine gets its own channels, and the exchange still adds up."""
    import torch

    from moetune.runtime import EPBuffer, get_model

    monkeypatch.setattr(hs.HostStagedTransport, "combine_shares_lanes", classmethod(lambda cls, d, o: True))
    model = get_model("custom:64,32,8,2,float32")
    buf = EPBuffer(knobs=Knobs.parse("transport=host_staged,pipeline_depth=2,channels=2"), model=model,
                   max_tokens=40, dense=False)
    try:
        assert buf.transport.native is False
        assert buf._combine_base == buf.comm_channels == 2  # combine on channels 2, 3: its own
        x = torch.randn(40, 64, generator=torch.Generator().manual_seed(0))
        idx = torch.randint(0, 8, (40, 2), generator=torch.Generator().manual_seed(1))
        w = torch.rand(40, 2, generator=torch.Generator().manual_seed(2))
        recv, meta, h = buf.dispatch(x, idx, w)
        out = buf.combine(recv * meta.weights.sum(1, keepdim=True), h)
        assert torch.allclose(out, x * w.sum(1, keepdim=True), atol=1e-5)
    finally:
        buf.close()
    # an explicit knob is followed whatever runs
    buf = EPBuffer(knobs=Knobs.parse("transport=host_staged,pipeline_depth=2,channels=2,combine_lanes=shared"),
                   model=model, max_tokens=40, dense=False)
    assert buf._combine_base == 0
    buf.close()


def test_the_copy_engine_path_shares_and_gives_back_the_combine_lanes() -> None:
    """Where the copy engines run, combine goes on the dispatch lanes (run 34), and the lanes built for combine
    are given back before any staging memory is set up for them (each lane holds a ring per rank pair)."""
    t = _bare(2, 0, 4, 4096)
    t.native, t._mm = True, None
    assert t.settle_combine_lanes(2) is True
    assert t.lanes == 2 and len(t._sent) == len(t._recvd) == 2
    fallen = _bare(2, 0, 4, 4096)
    fallen.native, fallen._mm = False, None
    assert fallen.settle_combine_lanes(2) is False and fallen.lanes == 4


# -- the copy-engine path checks what it copies by address ---------------------------------------------------------


def test_rows_that_do_not_match_the_splits_are_refused_before_anything_is_posted(monkeypatch: pytest.MonkeyPatch) -> None:
    """The native path posts raw device addresses and byte counts: splits naming more rows than `send` holds made it
    read past the tensor, an `out` shorter than the received rows made the receiver's copies write past it, and a
    strided tensor copied as if contiguous -- each is a ValueError before any ring counter moves, as the collective
    path (NCCL) refuses each, never posted without a word."""
    import torch

    t, lib = _posting(monkeypatch)
    t.native, t._peers = True, [1]
    send = torch.zeros(4, 8)
    bad = [
        (lambda: t.exchange_async(send, [2, 5], [2, 1]), "splits name 7 send rows"),
        (lambda: t.exchange_async(send, [2, 2], [2, 6], out=torch.zeros(3, 8)), "8 received rows.*out 3"),
        (lambda: t.exchange_async(torch.zeros(8, 4).t(), [2, 2], [2, 2]), "send must be contiguous"),
        (lambda: t.exchange_async(send, [2, 2], [2, 2], out=torch.zeros(4, 8, dtype=torch.float64)), "one dtype"),
        (lambda: t.exchange_async(send, [2, -1, 3], [2, 2]), "send_splits must be 2 ints >= 0"),
        (lambda: t.exchange_async(send, [4, 0], [-1, 5]), "recv_splits must be 2 ints >= 0"),
        (lambda: t.gather_async(torch.zeros(7, 8), torch.zeros(4, 8)), "inp has 4 rows and out 7; expected 4 and 8"),
        (lambda: t.gather_async(torch.zeros(8, 4), torch.zeros(4, 8)), "one dtype and shape"),
        (lambda: t.reduce_scatter_async(torch.zeros(4, 8), torch.zeros(6, 8)), "expected 4 and 8"),
        (lambda: t.reduce_scatter_async(torch.zeros(4, 8), torch.zeros(16, 4).t()), "inp must be contiguous"),
    ]
    for call, match in bad:
        with pytest.raises(ValueError, match=match):
            call()
    assert lib.posts == [] and t._sent == [[0, 0]] and t._recvd == [[0, 0]] and not t._broken
    # matching rows still go
    t.exchange_async(send, [2, 2], [2, 1])
    t.gather_async(torch.zeros(8, 8), send)
    t.reduce_scatter_async(torch.zeros(2, 8), send)
    assert len(lib.posts) == 3


def test_a_closed_transport_says_so_and_never_hands_the_library_a_null_handle(monkeypatch: pytest.MonkeyPatch) -> None:
    """close() destroys the library's context and frees the staging memory, and the transport remembers it: a work
    posted before close() and waited after it, a later exchange and stage_capacity each raise HostStagedError saying
    the transport is closed. Otherwise the wait would call mt_hs_wait with the NULL handle (the library dereferences
    it: a crash, not an error), and the exchange set the staging memory up again on this rank alone (a collective
    its peers never join)."""
    import torch

    t, lib = _posting(monkeypatch)
    t.native, t._peers = True, [1]
    handles: list[int | None] = []
    lib.mt_hs_wait = lambda h, *a: handles.append(h.value) or 0
    lib.mt_hs_destroy = lambda h: 0
    t._mm = SimpleNamespace(close=lambda: None)  # the staging mapping, "set up"
    setups: list[int] = []
    monkeypatch.setattr(t, "_setup", lambda: setups.append(1))
    send = torch.zeros(4, 8)
    _, work = t.exchange_async(send, [2, 2], [2, 2])
    t.close()
    assert not t._h and t._mm is None
    with pytest.raises(hs.HostStagedError, match="closed before this exchange was waited for"):
        work.wait()
    for call in (lambda: t.exchange_async(send, [2, 2], [2, 2]), lambda: t.gather_async(torch.zeros(8, 8), send),
                 lambda: t.reduce_scatter_async(torch.zeros(2, 8), send), lambda: t.stage_capacity(16, 64)):
        with pytest.raises(hs.HostStagedError, match="the transport is closed"):
            call()
    assert handles == [] and setups == [] and len(lib.posts) == 1
    t.close()  # twice: nothing more


def test_close_raises_naming_a_destroy_that_leaked_and_keeps_the_staging_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """mt_hs_destroy past its timeout (a lane stream still copying) leaks the registration and returns nonzero; close()
    then keeps the mapping (and the tensors failed posts hold) for the life of the process, rather than unmap the
    staging memory under the copy, and raises a RuntimeError naming the leak; a second close does nothing."""
    import torch

    t, lib = _posting(monkeypatch)
    closed: list[int] = []
    lib.mt_hs_destroy = lambda h: 317
    lib.mt_last_error = lambda: b"mt_hs_destroy: lane 0's send stream did not complete its copies within 20.0 s"
    t._mm, t._anchor = SimpleNamespace(close=lambda: closed.append(1)), object()
    held = (torch.zeros(4),)
    t._held_after_failure = [held]
    with pytest.raises(RuntimeError, match=r"host_staged on rank 0: close: mt_hs_destroy returned 317: mt_hs_destroy: "
                                           r"lane 0's send stream .* the staging memory is leaked rather than freed"):
        t.close()
    assert closed == [] and not t._h and t._mm is None and t._held_after_failure == []
    t.close()  # once
    assert closed == []
