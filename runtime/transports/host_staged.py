"""The `host_staged` transport: rows staged through pinned host memory by the GPUs' copy engines.

For nodes whose GPUs cannot reach each other directly (PCIe boxes with peer-to-peer off): every block
crosses PCIe twice, device → host on the sender, host → device on the receiver. The host
memory is one shared file under /dev/shm (mode 0600, unlinked as soon as every rank has mapped it, so
nothing is left behind by a crash) that each rank registers with CUDA (`cudaHostRegister`). It holds,
for every (lane, sender, receiver), a ring of staging slots (the knob `staging_slots`), each with a full/empty flag (the
sender fills a slot, the receiver empties it); csrc/host_staged.cu orders wait → copy → flag on the CUDA
streams, so no host thread ever waits for a transfer and the copies run on the copy engines, not on SMs
(the waits are cuStreamWaitValue64, given their timeout by a watchdog thread; the knob `wait_mode`).
The flag values are constants, so an exchange can be captured in a CUDA graph and replayed (the EP
buffer's dense layout, which has no host sync, captures whole).

Two knobs overlap the two crossings:
* `chunk_tokens` (the staging message size): each block is cut into pieces of that many rows, which go
  through the ring of slots one after another, so piece j+1 goes down to host memory while the receiver
  brings piece j up (double buffering inside one exchange, posted by one library call). With 0 a
  block goes whole through one slot: store-and-forward, the receiver's host → device copy starts when
  the sender's device → host copy has ended.
* `pipeline_depth` (the EP buffer's chunks): chunk i+1 travels while chunk i is computed, and the
  combine of chunk i travels while later dispatch chunks still do. The combines go on the dispatch lane
  (`settle_combine_lanes`: where this copy-engine path runs, not on the NCCL fallback; unless the knob `combine_lanes` says otherwise), so each copy stream carries d0..dN and then c0..cN back to back; `channels`
  spreads the chunks over that many pairs of CUDA streams (lanes), which then move at once.

The count exchange and the input checks stay on the process group (NCCL, with NCCL_P2P_DISABLE=1 on
such nodes, which the benchmarks set). Without the compiled library, on CPU, with one rank, or with the
runtime option hs_native=False (MOETUNE_HS_NATIVE=0) the transport is the collective over NCCL's own staging (NCCL_P2P_DISABLE=1),
which is what `host_staged` meant before this module; `native` says which one runs.
All ranks of the group must share one host (the staging memory is a node-local file): a group spanning hosts is
refused when the transport is built (`knobs.group_world_problem`, the rule autoload and the store ask of a profile;
NCCL's staging is refused there too, it is not what a host_staged profile tuned), transport=collective serves it.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import secrets
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from moetune.runtime import _args, csrc_build
from moetune.runtime.hosts import group_host_count
from moetune.runtime.knobs import KnobError, Knobs, group_world_problem
from moetune.runtime.options import RuntimeOptions
from moetune.runtime.transports._onesided import all_ok, decode_error, destroy_leak, keep_leaked
from moetune.runtime.transports.base import Availability, transport_device
from moetune.runtime.transports.collective import CollectiveTransport

# Staging slots per (lane, sender, receiver) come from the knob `staging_slots` (default 4: 2 is double
# buffering; 4 lets a pipelined sender run ahead of its receiver, run 34. On the H200 node, 4 slots gave
# nothing over 2 unpipelined, run 27, and 769 against 795 us with pipeline_depth 4, run 34).
DEFAULT_SLOT_BYTES = 8 << 20  # when the EP buffer did not size the slots (stage_capacity)
_PAGE = 4096
_SHM_DIR = "/dev/shm"
_NAME_BYTES = 64
ERR_DRAIN = 8  # csrc: waited too long for the receiver to drain a staging slot
_OP_WORDS = 5  # csrc HS_OP_WORDS: one piece for mt_hs_post


class HostStagedError(RuntimeError):
    """A staged transfer failed on the GPU (a peer never arrived) or the staging memory could not be set up."""


def wait_mode_code(knobs: Knobs) -> int:
    """The library's code for the knob `wait_mode`: `memop` (1, default) is cuStreamWaitValue64, no SM and the
    quickest hand-off to the copy (run 34), timed by the library's watchdog thread; `kernel` (0) is a one-thread
    spin kernel per wait with its own timeout. Both give up after the option onesided_timeout_s."""
    return 1 if knobs.wait_mode == "memop" else 0


def piece_sizes(n: int, slot: int) -> list[int]:
    """How a block of n bytes is cut for slots of `slot` bytes: full slots, then the rest. (Starting and
    ending with smaller pieces, to shorten the pipeline's fill and drain, was slower on the H200 node in
    run 24: each piece costs the host two launches.)"""
    return [min(slot, n - off) for off in range(0, n, slot)]


class _StagedWork:
    """What exchange_async/gather_async/reduce_scatter_async return: wait() orders the current stream after
    the exchange's copies (then runs `finish`, e.g. the reduce-scatter's sum) and raises a recorded GPU error.
    Until then it holds the tensors the copies read and write: the caching allocator only knows the stream
    they were made on, and a caller may drop its send rows right after posting (run 35: a pipelined
    combine's expert rows were reused by the next chunk before the lane stream had copied them)."""

    def __init__(self, transport: HostStagedTransport, lane: int, ticket: int,
                 finish: Callable[[], None] | None = None, keep: tuple[torch.Tensor, ...] = ()):
        self._t, self._lane, self._ticket, self._finish, self._keep = transport, lane, ticket, finish, keep

    def wait(self) -> bool:
        t = self._t
        if t._closed:  # its context is destroyed: the library would be handed a NULL handle (a crash, not an error)
            self._keep, self._finish = (), None
            raise HostStagedError(f"host_staged on rank {t.rank}: the transport was closed before this exchange was "
                                  "waited for; its rows are not to be read (wait for every exchange before close())")
        t._call(t.lib.mt_hs_wait, t._h, self._lane, self._ticket, torch.cuda.current_stream(t.device).cuda_stream)
        self._keep = ()  # the current stream now comes after the copies: reusing the memory is safe
        if self._finish is not None:
            self._finish()
            self._finish = None
        t.check()
        return True


class HostStagedTransport(CollectiveTransport):
    name: ClassVar[str] = "host_staged"
    # full/empty flags with constant values: a replay takes the slots in the captured order on every rank
    # (runtime_cases.case_gpu_host_staged replays captures, tests/test_runtime_gpu.py)
    graph_capturable: ClassVar[bool] = True
    _closed: bool = False  # close() was called: the copy-engine path refuses to post, set up or wait again

    def __init__(self, group: dist.ProcessGroup | None, knobs: Knobs, device: torch.device | str, *, channels: int = 1,
                 options: RuntimeOptions | Mapping[str, Any] | None = None):
        # the arguments are read before the base class sees them: checked and normalised as it would, and its
        # group/knob check first of all, before the collective below (a refused rank must not have joined one)
        who = f"{type(self).__name__}: "
        self.check_arguments(group, knobs, who)
        _args.check_int("channels", channels, 1, who)
        device = transport_device(device, who)
        options = RuntimeOptions.resolve(options)
        world = dist.get_world_size(group) if dist.is_initialized() else 1
        if world > 1:
            # the staging memory is one host's /dev/shm file: a rank on another host cannot map it (the copy-engine
            # path failed in its setup with a missing file; NCCL's staging ran unlike what was tuned). Counted before
            # any other collective, alike on every rank, so every rank raises the rule's words together
            on = device if dist.get_backend(group) == "nccl" else torch.device("cpu")
            far = group_world_problem(self.name, world, who, nodes=group_host_count(group, on))
            if far is not None:
                raise KnobError(far, ("transport",))
        lib, why = None, ""
        if device.type == "cuda" and world > 1 and options.hs_native:
            ok, why = csrc_build.availability()
            if ok:
                try:
                    lib = csrc_build.load()
                except Exception as e:  # a node without a working nvcc keeps NCCL's staging
                    lib, why = None, f"{type(e).__name__}: {e}"
        if device.type == "cuda" and world > 1 and dist.is_initialized():
            # every rank must take the same path (the NCCL path builds extra communicators collectively)
            if not all_ok(lib is not None, group, device) and lib is not None:
                lib, why = None, "another rank cannot run the native path"
        self.native = lib is not None
        self.native_reason = "copy engines through shared pinned host memory" if self.native else (
            why or ("hs_native=False (MOETUNE_HS_NATIVE=0)" if not options.hs_native
                    else "needs CUDA and more than one rank"))
        super().__init__(group, knobs, device, channels=1 if self.native else channels, options=options)
        self.lib = lib
        self.lanes = max(1, channels)
        self.slot_bytes = DEFAULT_SLOT_BYTES
        self.ring = knobs.staging_slots  # the same on every rank: the buffer's agreement compares the knobs
        self._h = ctypes.c_void_p()
        self._mm: mmap.mmap | None = None
        self._anchor: ctypes.Array | None = None
        # uses of each (lane, peer) ring so far, as sender and as receiver (the next slot follows from it)
        self._sent = [[0] * self.world for _ in range(self.lanes)]
        self._recvd = [[0] * self.world for _ in range(self.lanes)]
        # why no exchange may be posted any more: a failed mt_hs_post may have staged part of its pieces
        self._broken = ""
        self._held_after_failure: list[tuple[torch.Tensor, ...]] = []  # a failed post's tensors (see _move)
        self._peers = [p for p in range(self.world) if p != self.rank]

    @classmethod
    def combine_shares_lanes(cls, device: torch.device, options: RuntimeOptions) -> bool:
        """Pipelined, combine goes on the dispatch lane where the copy engines move the rows: each copy stream
        then carries d0..dN, then c0..cN back to back (run 34: 769-795 against 827-892 us with combine on
        its own lane). NCCL's staging keeps its own communicators for combine."""
        return device.type == "cuda" and options.hs_native and csrc_build.availability()[0]

    def settle_combine_lanes(self, dispatch_channels: int) -> bool:
        """What runs decides, not the prediction above: the copy-engine path shares (and gives back the combine
        lanes it was built with, before any staging memory exists for them); a transport that fell back to NCCL's
        staging (one rank without the library, a failed build, one rank) keeps the combine communicators it was
        built with. `native` is the same on every rank (agreed in the constructor)."""
        if not self.native:
            return False
        if self._mm is None and 1 <= dispatch_channels < self.lanes:
            self.lanes = dispatch_channels
            self._sent = [[0] * self.world for _ in range(self.lanes)]
            self._recvd = [[0] * self.world for _ in range(self.lanes)]
        return True

    @classmethod
    def availability(cls, device: torch.device | None = None, options: RuntimeOptions | None = None) -> Availability:
        base = CollectiveTransport.availability(device)
        if not base.ok:
            return base
        if device is not None and device.type == "cuda":
            native = (options if options is not None else RuntimeOptions.resolve()).hs_native
            # the compiled library only where the native path is on: probing it may build csrc/ with nvcc
            ok, why = csrc_build.availability() if native else (False, "MOETUNE_HS_NATIVE=0")
            if ok:
                return Availability(True, "copy engines through shared pinned host memory (csrc/host_staged.cu)")
            if os.environ.get("NCCL_P2P_DISABLE", "0") != "1":
                return Availability(True, f"NCCL's staging; set NCCL_P2P_DISABLE=1 before NCCL initialises ({why})")
            return Availability(True, f"NCCL's staging through host memory ({why})")
        return Availability(True, "collective staged through host memory")

    # -- staging memory ------------------------------------------------------------------------------
    def stage_capacity(self, rows: int, row_bytes: int) -> None:
        """Size the slots for blocks of up to `rows` rows of `row_bytes` (collective: every rank, same
        arguments) and set up the staging memory. With chunk_tokens a slot holds that many rows (the
        staging message); larger blocks always work, through consecutive slots."""
        if not self.native or self._mm is not None:
            return
        self._refuse_closed()
        if self.knobs.chunk_tokens:
            rows = min(rows, self.knobs.chunk_tokens)
        self.slot_bytes = max(_PAGE, -(-max(1, rows) * max(1, row_bytes) // _PAGE) * _PAGE)
        self._setup()

    def _pair(self, src: int, dst: int) -> int:
        return src * (self.world - 1) + (dst if dst < src else dst - 1)

    def _slot_index(self, lane: int, src: int, dst: int, slot: int) -> int:
        return (lane * self.world * (self.world - 1) + self._pair(src, dst)) * self.ring + slot

    def _offsets(self, lane: int, src: int, dst: int, slot: int) -> tuple[int, int]:
        """(data, flag) byte offsets of one slot in the staging memory: the flags first, then the data."""
        i = self._slot_index(lane, src, dst, slot)
        return self._data_base + i * self.slot_bytes, 8 * i

    def _setup(self) -> None:
        n_slots = self.lanes * self.world * (self.world - 1) * self.ring
        self._data_base = -(-8 * n_slots // _PAGE) * _PAGE
        nbytes = self._data_base + n_slots * self.slot_bytes
        name, problem = "", ""
        created = ""  # the file this process made (rank 0): unlinked whatever happens after it exists
        try:
            if self.rank == 0:
                try:
                    st = os.statvfs(_SHM_DIR)
                    free = st.f_bavail * st.f_frsize
                    if free < nbytes:
                        raise OSError(f"{_SHM_DIR} has {free >> 20} MiB free, the staging memory needs {nbytes >> 20} MiB")
                    name = os.path.join(_SHM_DIR, f"moetune-hs-{os.getpid()}-{secrets.token_hex(8)}")
                    fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)  # owner only
                    created = name  # O_EXCL: this file is ours, and only this one may be unlinked
                    try:
                        os.ftruncate(fd, nbytes)
                    finally:
                        os.close(fd)
                except OSError as e:
                    problem, name = f"{type(e).__name__}: {e}", ""  # the others are told "" (no memory)
            name = self._broadcast_name(name)
            if name and not problem:
                try:
                    fd = os.open(name, os.O_RDWR)
                    try:
                        if os.fstat(fd).st_size != nbytes:
                            raise OSError(f"{name} has {os.fstat(fd).st_size} bytes, expected {nbytes} (not one host, "
                                          "or other staging_slots?)")
                        self._mm = mmap.mmap(fd, nbytes)
                    finally:
                        os.close(fd)
                    self._anchor = ctypes.c_char.from_buffer(self._mm)
                    rc = self.lib.mt_hs_create(self.device.index or 0, self.rank, ctypes.addressof(self._anchor),
                                               nbytes, self.options.onesided_timeout_s, wait_mode_code(self.knobs),
                                               self.lanes, ctypes.byref(self._h))
                    if rc:
                        raise HostStagedError(self.lib.mt_last_error().decode(errors="replace"))
                except (OSError, HostStagedError) as e:
                    problem = f"{type(e).__name__}: {e}"
            elif not problem:
                problem = "rank 0 could not create the staging memory"
            ok = all_ok(not problem, self.group, self.device)
        finally:
            # after all_ok every rank has it mapped (or gave up); after an exception (the broadcast, all_ok) the
            # setup is over for this rank too: either way nothing stays in /dev/shm
            if created:
                try:
                    os.unlink(created)
                except OSError:
                    pass
        if not ok:
            leak = self._release()
            error = HostStagedError(
                f"host_staged on rank {self.rank}: the staging memory could not be set up on every rank"
                + (f" ({problem})" if problem else "") + "; hs_native=False (MOETUNE_HS_NATIVE=0) uses NCCL's staging instead")
            if leak:  # noted, not raised over the cause
                error.add_note(f"releasing the staging memory: {leak}")
            raise error

    def _broadcast_name(self, name: str) -> str:
        raw = name.encode()[:_NAME_BYTES].ljust(_NAME_BYTES, b"\0")
        t = torch.tensor(list(raw), dtype=torch.uint8, device=self.device)
        dist.broadcast(t, src=dist.get_global_rank(self.group, 0) if self.group is not None else 0, group=self.group)
        return bytes(t.cpu().tolist()).rstrip(b"\0").decode()

    def check(self) -> None:
        """Raise HostStagedError when a wait on the GPU timed out (read from host memory, no sync), or when an
        earlier post failed and left the rings out of step with the peers'."""
        if self._broken:
            raise HostStagedError(self._broken)
        if not self._h:
            return
        words = (ctypes.c_int * 16)()
        self.lib.mt_hs_error(self._h, words)
        if words[0]:
            what = ("timeout waiting for a peer to drain a staging slot" if words[0] == ERR_DRAIN
                    else decode_error(list(words)))
            raise HostStagedError(f"host_staged on rank {self.rank}: {what} (peer {words[2]}); the peer is gone or "
                                  f"stalled beyond onesided_timeout_s={self.options.onesided_timeout_s:g} "
                                  "(MOETUNE_ONESIDED_TIMEOUT_S)")

    def flag_values(self, lane: int, src: int, dst: int) -> list[int]:
        """The flag of each slot of the (lane, src -> dst) ring (1 = full, 0 = empty), read by the CPU
        (diagnostics; no sync)."""
        if self._mm is None:
            return []
        flags = [self._offsets(lane, src, dst, slot)[1] for slot in range(self.ring)]
        return [int.from_bytes(self._mm[f : f + 8], "little") for f in flags]

    def host_stats(self) -> dict[str, tuple[float, int]]:
        """Host time (µs) and calls spent in each kind of CUDA call the staging made (diagnostics)."""
        if not self._h:
            return {}
        v = (ctypes.c_uint64 * 10)()
        self.lib.mt_hs_stats(self._h, v)
        names = ("events", "local_copy", "wait_launch", "staging_copy", "flag_write")
        return {n: (v[i] / 1e3, int(v[5 + i])) for i, n in enumerate(names)}

    # -- moving blocks ---------------------------------------------------------------------------------
    def _call(self, fn: Callable[..., int], *args: object) -> None:
        rc = fn(*args)
        if rc:
            raise HostStagedError(f"host_staged on rank {self.rank}: {self.lib.mt_last_error().decode(errors='replace')}")

    def _move(self, channel: int, sends: list[tuple[int, int, int]], recvs: list[tuple[int, int, int]],
              local: tuple[torch.Tensor, torch.Tensor] | None, finish: Callable[[], None] | None = None,
              keep: tuple[torch.Tensor, ...] = ()) -> _StagedWork:
        """Post (peer, device address, bytes) blocks out and in on the streams of the channel's lane, after the
        current stream's work; `local` = (dst, src) is this rank's own block (a device copy). One library
        call; the returned work's wait() orders the current stream after it, then runs `finish`; it holds
        `keep` (the tensors behind the addresses) until then.

        Pieces are posted send j, receive j, send j+1, ...: should the two streams share one hardware queue
        (CUDA_DEVICE_MAX_CONNECTIONS), a send that waits for the peer to drain slot j-ring still comes after
        this rank's own receive of piece j-ring, so with two ranks the ring cannot deadlock."""
        self._refuse_closed()
        if self._mm is None:
            self._setup()
        self.check()
        lane = channel % self.lanes
        sent, recvd = list(self._sent[lane]), list(self._recvd[lane])
        try:
            out = [a for peer, ptr, n in sends for a in self._pieces(lane, self.rank, peer, ptr, n, self._sent)]
            inc = [a for peer, ptr, n in recvs for a in self._pieces(lane, peer, self.rank, ptr, n, self._recvd)]
            ops_out = (ctypes.c_uint64 * (_OP_WORDS * len(out) or 1))(*[v for op in out for v in op])
            ops_in = (ctypes.c_uint64 * (_OP_WORDS * len(inc) or 1))(*[v for op in inc for v in op])
            nb = local[0].numel() * local[0].element_size() if local is not None else 0
            stream = torch.cuda.current_stream(self.device).cuda_stream
        except BaseException:
            # nothing reached the library: the counters go back, this rank stays in step with its peers
            self._sent[lane], self._recvd[lane] = sent, recvd
            raise
        ticket = ctypes.c_int()
        rc = self.lib.mt_hs_post(self._h, lane, stream, len(out), ops_out, len(inc), ops_in,
                                 local[0].data_ptr() if nb else None, local[1].data_ptr() if nb else None, nb,
                                 ctypes.byref(ticket))
        if rc:
            # the library stages piece by piece: it may have queued some pieces' waits, copies and flag writes
            # (and the lane's busy word) before failing. Rolling the counters back would hand those slots out
            # again; keeping them skips pieces the peers still expect. Either way the rings no longer match
            # the peers', so no later exchange may run on this transport.
            why = self.lib.mt_last_error().decode(errors="replace")
            self._broken = (f"host_staged on rank {self.rank}: an earlier exchange failed while being posted ({why}); "
                            "its staging rings may be partly used and no longer match the peers', so this transport "
                            "cannot be used again (the peers' waits on it will time out); close it and set up the "
                            "EP buffer anew on every rank")
            # and the pieces it queued still copy into (and from) these tensors once the peers' flags come, so
            # they stay allocated until close() (freed now, the caching allocator would hand their memory to
            # unrelated tensors under those copies)
            self._held_after_failure.append(keep)
            raise HostStagedError(self._broken)
        return _StagedWork(self, lane, ticket.value, finish, keep)

    def _pieces(self, lane: int, src: int, dst: int, ptr: int, n: int, uses: list[list[int]]) -> list[tuple]:
        """One block cut for consecutive slots of the (lane, src -> dst) ring (both sides cut it alike, and
        both count the ring's uses alike): the (data, address, bytes, flag, peer) of each piece."""
        peer = dst if src == self.rank else src
        pieces = []
        off = 0
        for size in piece_sizes(n, self.slot_bytes):
            k = uses[lane][peer]
            uses[lane][peer] = k + 1
            data, flag = self._offsets(lane, src, dst, k % self.ring)
            pieces.append((data, ptr + off, size, flag, peer))
            off += size
        return pieces

    # -- what the EP buffer uses (same contracts as CollectiveTransport) -------------------------------------
    def _check_tensors(self, what: str, **tensors: torch.Tensor) -> None:
        """The copies below go by raw device addresses and byte counts: a tensor that is not a contiguous one on this
        transport's device would be read or written past its end, or in the wrong order, where NCCL refuses it.
        ValueError, before any ring counter moves (nothing posted)."""
        for name, t in tensors.items():
            if not isinstance(t, torch.Tensor) or t.dim() < 1:
                raise ValueError(f"host_staged {what}: {name} must be a tensor of rows, got "
                                 f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
            if t.device != self.device:
                raise ValueError(f"host_staged {what}: {name} must be on {self.device}, got {t.device}")
            if not t.is_contiguous():
                raise ValueError(f"host_staged {what}: {name} must be contiguous (its rows are copied by address)")

    def _check_same_rows(self, what: str, a: tuple[str, torch.Tensor], b: tuple[str, torch.Tensor],
                         a_rows: int, b_rows: int) -> None:
        (an, at), (bn, bt) = a, b
        if at.dtype != bt.dtype or tuple(at.shape[1:]) != tuple(bt.shape[1:]):
            raise ValueError(f"host_staged {what}: {an} and {bn} must have rows of one dtype and shape, got "
                             f"{at.dtype} {tuple(at.shape)} and {bt.dtype} {tuple(bt.shape)}")
        if at.shape[0] != a_rows or bt.shape[0] != b_rows:
            raise ValueError(f"host_staged {what}: {an} has {at.shape[0]} rows and {bn} {bt.shape[0]}; expected "
                             f"{a_rows} and {b_rows}")

    def _check_splits(self, name: str, splits: Any) -> list[int]:
        if (not isinstance(splits, (list, tuple)) or len(splits) != self.world
                or any(not isinstance(n, int) or isinstance(n, bool) or n < 0 for n in splits)):
            raise ValueError(f"host_staged exchange_async: {name} must be {self.world} ints >= 0 (rows per rank), "
                             f"got {splits!r}")
        return list(splits)

    def exchange_async(self, send: torch.Tensor, send_splits: list[int], recv_splits: list[int],
                       out: torch.Tensor | None = None, *, channel: int = 0):
        if not self.native:
            return super().exchange_async(send, send_splits, recv_splits, out, channel=channel)
        send_splits = self._check_splits("send_splits", send_splits)
        recv_splits = self._check_splits("recv_splits", recv_splits)
        self._check_tensors("exchange_async", send=send)
        rows = sum(recv_splits)
        if out is None:
            out = torch.empty((rows, *send.shape[1:]), dtype=send.dtype, device=send.device)
        self._check_tensors("exchange_async", out=out)
        if sum(send_splits) != send.shape[0] or rows != out.shape[0]:
            raise ValueError(f"host_staged exchange_async: the splits name {sum(send_splits)} send rows and {rows} "
                             f"received rows; send has {send.shape[0]}, out {out.shape[0]}")
        self._check_same_rows("exchange_async", ("send", send), ("out", out), send.shape[0], rows)
        row = math.prod(send.shape[1:]) * send.element_size()
        s_off = [0]
        r_off = [0]
        for d in range(self.world):
            s_off.append(s_off[-1] + send_splits[d])
            r_off.append(r_off[-1] + recv_splits[d])
        sends = [(p, send.data_ptr() + s_off[p] * row, send_splits[p] * row) for p in range(self.world)
                 if p != self.rank and send_splits[p]]
        recvs = [(p, out.data_ptr() + r_off[p] * row, recv_splits[p] * row) for p in range(self.world)
                 if p != self.rank and recv_splits[p]]
        me = self.rank
        return out, self._move(channel, sends, recvs, (out[r_off[me] : r_off[me + 1]], send[s_off[me] : s_off[me + 1]]),
                               keep=(send, out))

    def gather_async(self, out: torch.Tensor, inp: torch.Tensor, *, channel: int = 0):
        if not self.native:
            return super().gather_async(out, inp, channel=channel)
        self._check_tensors("gather_async", out=out, inp=inp)
        self._check_same_rows("gather_async", ("inp", inp), ("out", out), inp.shape[0], self.world * inp.shape[0])
        n = inp.shape[0]
        nb = inp.numel() * inp.element_size()
        peers = self._peers
        sends = [(p, inp.data_ptr(), nb) for p in peers] if nb else []
        recvs = [(p, out[p * n].data_ptr(), nb) for p in peers] if nb else []
        return self._move(channel, sends, recvs, (out[self.rank * n : (self.rank + 1) * n], inp), keep=(out, inp))

    def reduce_scatter_async(self, out: torch.Tensor, inp: torch.Tensor, *, channel: int = 0):
        if not self.native:
            return super().reduce_scatter_async(out, inp, channel=channel)
        self._check_tensors("reduce_scatter_async", out=out, inp=inp)
        self._check_same_rows("reduce_scatter_async", ("out", out), ("inp", inp), out.shape[0],
                              self.world * out.shape[0])
        n = out.shape[0]
        nb = out.numel() * out.element_size()
        peers = self._peers
        got = torch.empty((len(peers), *out.shape), dtype=out.dtype, device=out.device)
        sends = [(p, inp[p * n].data_ptr(), nb) for p in peers] if nb else []
        recvs = [(p, got[i].data_ptr(), nb) for i, p in enumerate(peers)] if nb else []
        mine = inp[self.rank * n : (self.rank + 1) * n]

        def finish() -> None:
            # every rank's block in rank order; with two ranks one rounding, as a sum in the collective
            blocks = [got[i] for i in range(self.rank)] + [mine] + [got[i] for i in range(self.rank, len(peers))]
            if len(blocks) == 2:
                torch.add(blocks[0], blocks[1], out=out)
            else:
                acc = blocks[0].float()
                for b in blocks[1:]:
                    acc += b.float()
                out.copy_(acc)

        return self._move(channel, sends, recvs, None, finish, keep=(inp, got))

    # -- teardown ---------------------------------------------------------------------------------------
    def _release(self) -> str | None:
        """Destroy the library's context and unmap the staging memory. Returns what mt_hs_destroy leaked where a lane
        stream did not complete within the timeout: then the mapping (and what failed posts hold) is kept for the
        life of the process instead, as a copy may still touch it."""
        if self._h:
            # waits (bounded) for the lane streams: no copy still touches the memory
            leak = destroy_leak(self.lib, "mt_hs_destroy", self.lib.mt_hs_destroy(self._h))
            self._h = ctypes.c_void_p()
            if leak:
                keep_leaked(self._mm, self._anchor, self._held_after_failure)
                self._mm, self._anchor, self._held_after_failure = None, None, []
                return leak
        self._held_after_failure = []  # the device is done with them (destroy waited)
        self._anchor = None
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # an exported view is still alive somewhere: the mapping goes with the process
                pass
            self._mm = None
        return None

    def _refuse_closed(self) -> None:
        """After close() the staging memory and the library's context are gone: a later exchange would set them up
        again on this rank alone (a collective its peers never join: a hang), and a wait would hand the library a
        NULL handle."""
        if self._closed:
            raise HostStagedError(f"host_staged on rank {self.rank}: the transport is closed (its staging memory is "
                                  "freed); build a new one")

    def close(self) -> None:
        """Free the staging memory and the communicators. Raises RuntimeError where a copy did not complete within
        onesided_timeout_s (the staging memory is then leaked rather than freed under it)."""
        self._closed = True
        leak = self._release()
        super().close()
        if leak:
            raise RuntimeError(f"host_staged on rank {self.rank}: close: {leak}; the staging memory is leaked rather "
                               "than freed under it")
