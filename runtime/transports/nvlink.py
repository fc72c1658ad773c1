"""`nvlink` transport: GPU kernels store packed rows straight into the peer's receive buffer.

One kernel launch per exchange (csrc/ep_nvlink.cu): the count-matrix row goes out as tagged 8-byte
words, offsets inside each receiver's buffer are computed on the GPU, rows move with 16-byte vector
stores over NVLink, then signals: `coupled` = a system fence and a signal per CTA transfer,
`decoupled` = CTAs bump a per-group counter and the last CTA of a group issues one system fence and
the group's signals. Receivers spin (bounded) on epoch-valued signals; a timeout is written to
host-mapped memory and raised here as OneSidedError instead of hanging. No host round trip in the
data path. Knobs used: signalling, group_size (CTAs per fence when decoupled; 0 = per PE), num_sms.
"""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from moetune.runtime import csrc_build
from moetune.runtime.knobs import Knobs
from moetune.runtime.options import RuntimeOptions
from moetune.runtime.transports._onesided import (
    OneSidedError,
    OneSidedTransport,
    destroy_native,
    on_collect,
    one_sided_availability,
    run_now,
    u64_array,
)
from moetune.runtime.transports.base import Availability


class NvlinkTransport(OneSidedTransport):
    name: ClassVar[str] = "nvlink"
    # counts and signals stay on the GPU: selftest.epbuffer_worker replays a capture (tests/test_gpu_onesided.py)
    graph_capturable: ClassVar[bool] = True
    fused_counts: ClassVar[bool] = True
    strided_combine: ClassVar[bool] = True
    gathers_tokens: ClassVar[bool] = True
    _h: ctypes.c_void_p | None = None  # the kernels' context (None until mt_nvl_create made it, and after close)
    _native: weakref.finalize | None = None  # destroys _h once: at close(), or when collected

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        knobs: Knobs,
        device: torch.device | str,
        *,
        max_send_rows: int | None = None,
        row_bytes: int | None = None,
        options: RuntimeOptions | Mapping[str, Any] | None = None,
    ):
        # (knobs of another transport are refused by the base class: rewriting them would run other settings)
        super().__init__(group, knobs, device, max_send_rows=max_send_rows, row_bytes=row_bytes, options=options)
        try:
            h = ctypes.c_void_p()
            csrc_build.check(
                self.lib,
                self.lib.mt_nvl_create(
                    self.device.index, self.rank, self.world, u64_array(self.ctrl.peer_ptrs), int(knobs.num_sms),
                    self.timeout_s, ctypes.byref(h),
                ),
                "mt_nvl_create",
            )
            self._h = h
            # a transport dropped without close() destroys its kernels' context (device memory: the error record,
            # abort flag, group counters, epochs) when collected; not its symmetric buffers: freeing those is
            # collective in spirit, other ranks may still write into them (as the proxy transport)
            self._native = on_collect(self, _destroy_nvl_native, self.lib, h)
            self._map_error_record(h, self.lib.mt_nvl_err_ptr)
            cpp = ctypes.c_int(0)
            self.lib.mt_nvl_ctas_per_peer(h, ctypes.byref(cpp))
            self.ctas_per_peer = cpp.value
            self._coupled = 1 if knobs.signalling == "coupled" else 0
            self._group = int(knobs.group_size)
            if max_send_rows is not None and row_bytes is not None:
                self.reserve(max_send_rows, row_bytes)
        except BaseException as e:  # the symmetric buffers exist already: nobody else can free them
            self._release_after_failure(e)
            raise

    @classmethod
    def availability(cls, device: torch.device | None = None, options: RuntimeOptions | None = None) -> Availability:
        a = one_sided_availability(device)
        if not a.ok:
            return a
        n = torch.cuda.device_count()
        if n >= 2:
            ok = ctypes.c_int(0)
            lib = csrc_build.load()
            if lib.mt_can_access_peer(0, 1, ctypes.byref(ok)) == 0 and not ok.value:
                return Availability(False, "GPU 0 cannot access GPU 1 (no P2P/NVLink): use proxy or host_staged")
        return Availability(True, a.reason)

    def _set_data(self) -> None:
        assert self.data is not None
        csrc_build.check(
            self.lib, self.lib.mt_nvl_set_data(self._h, u64_array(self.data.peer_ptrs), self.data_bytes), "mt_nvl_set_data"
        )

    def exchange_counts(self, send_counts: torch.Tensor) -> torch.Tensor:
        self.check()
        sc = self._counts_arg(send_counts)
        out = torch.empty(self.world, dtype=torch.int64, device=self.device)
        self._counts_epoch += 1
        rc = self.lib.mt_nvl_counts(self._h, sc.data_ptr(), out.data_ptr(), self._stream())
        csrc_build.check(self.lib, rc, "mt_nvl_counts")
        self._keep_counts = sc
        return out

    def exchange(self, send: torch.Tensor, send_counts: torch.Tensor, recv_counts: torch.Tensor) -> torch.Tensor:
        """One launch; the returned view stays valid until this rank's second next exchange() call.

        The epoch lives on the device (the kernels advance it), so a capture of an even number of
        exchanges in a CUDA graph replays correctly; the host counter only picks the parity view.
        """
        return self._launch(send, send_counts, recv_counts, None)

    def exchange_fused(self, send: torch.Tensor, send_counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Dispatch without a separate exchange_counts(): one launch returns (rows, recv_counts).

        The counts travel inside the exchange anyway (the count matrix that places rows on the GPU);
        this saves a launch and a round trip. recv_counts is an int64 device tensor (stream-ordered).
        """
        out = torch.empty(self.world, dtype=torch.int64, device=self.device)
        return self._launch(send, send_counts, None, out), out

    def exchange_strided(self, rows: torch.Tensor, send_counts: torch.Tensor, recv_counts: torch.Tensor) -> torch.Tensor:
        """exchange() of a 2-D tensor whose rows are strided (unit column stride), read in place: e.g.
        the payload columns of a receive buffer sent back by combine without a compacting copy."""
        if rows.dim() != 2 or rows.shape[1] == 0 or not _rows_in_place(rows):
            return self.exchange(rows, send_counts, recv_counts)
        self.check()
        if rows.device != self.device:
            raise ValueError(f"{self.name}: rows must be on {self.device}, got {rows.device}")
        es = rows.element_size()
        rb, stride = rows.shape[1] * es, rows.stride(0) * es
        self._ensure_capacity(rows.shape[0], rb)
        sc, rcv = self._counts_arg(send_counts), self._counts_arg(recv_counts)
        self._epoch += 1
        rc = self.lib.mt_nvl_exchange_strided(self._h, rows.data_ptr(), rows.shape[0], max(stride, rb), rb,
                                              sc.data_ptr(), rcv.data_ptr(), None, self._coupled, self._group,
                                              self._stream())
        csrc_build.check(self.lib, rc, "mt_nvl_exchange_strided")
        self._keep = (rows, sc, rcv)
        return self._recv_rows(rows.dtype, (rows.shape[1],), rb, self._epoch)

    def dispatch_gather(self, x: torch.Tensor, tok: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor,
                        send_counts: torch.Tensor, *, row_bytes: int, id_off: int, weight_off: int
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """Dispatch in one launch from the tokens themselves: send row i (rank-major order, `send_counts`
        rows per rank) is token tok[i]'s wire row -- x's payload bytes, its k int64 ids and fp32 weights --
        written straight into the receiver's buffer. Returns (received rows uint8 [cap, row_bytes],
        recv_counts int64 device tensor). x: [S, H] with unit column stride; idx int64 / weights fp32
        [S, k] contiguous."""
        self.check()
        for name, t, dt in (("tok", tok, torch.int64), ("idx", idx, torch.int64), ("weights", weights, torch.float32)):
            if t.device != self.device or t.dtype != dt or not t.is_contiguous():
                raise ValueError(f"{self.name}: {name} must be a contiguous {dt} tensor on {self.device}, "
                                 f"got {t.dtype} on {t.device}")
        if x.device != self.device or x.dim() != 2 or idx.dim() != 2 or weights.shape != idx.shape \
                or idx.shape[0] != x.shape[0] or tok.numel() < int(x.shape[0]) * self.world:
            raise ValueError(f"{self.name}: dispatch_gather needs x [S, H] on {self.device}, idx/weights [S, k] and "
                             f"tok of S x world entries; got x {tuple(x.shape)} on {x.device}, idx "
                             f"{tuple(idx.shape)}, weights {tuple(weights.shape)}, tok {tuple(tok.shape)}")
        if not _rows_in_place(x):
            x = x.contiguous()
        k = idx.shape[1]
        payload = x.shape[1] * x.element_size()
        self._ensure_capacity(tok.shape[0], row_bytes)
        sc = self._counts_arg(send_counts)
        out = torch.empty(self.world, dtype=torch.int64, device=self.device)
        self._epoch += 1
        # the kernel checks what bounds its source: the counts against tok's entries, each token they reach against
        # x's rows (idx and weights have as many)
        rc = self.lib.mt_nvl_exchange_gather(
            self._h, x.data_ptr(), x.shape[0], max(x.stride(0) * x.element_size(), payload), payload, tok.data_ptr(),
            tok.numel(), idx.data_ptr(), weights.data_ptr(), k, row_bytes, id_off, weight_off, sc.data_ptr(),
            out.data_ptr(), self._coupled, self._group, self._stream(),
        )
        csrc_build.check(self.lib, rc, "mt_nvl_exchange_gather")
        self._keep = (x, tok, idx, weights, sc)
        return self._recv_rows(torch.uint8, (row_bytes,), row_bytes, self._epoch), out

    def _launch(self, send: torch.Tensor, send_counts: torch.Tensor, recv_counts: torch.Tensor | None,
                recv_out: torch.Tensor | None) -> torch.Tensor:
        send, rb, sc = self._prepare(send, send_counts)
        rcv = self._counts_arg(recv_counts) if recv_counts is not None else None
        self._epoch += 1
        rc = self.lib.mt_nvl_exchange(
            self._h, send.data_ptr(), send.shape[0], rb, sc.data_ptr(), rcv.data_ptr() if rcv is not None else None,
            recv_out.data_ptr() if recv_out is not None else None, self._coupled, self._group, self._stream(),
        )
        csrc_build.check(self.lib, rc, "mt_nvl_exchange")
        self._keep = (send, sc, rcv)
        return self._recv_view(send, rb, self._epoch)

    def error_words(self) -> list[int]:
        if self._h is None:  # the C side would read through a NULL context
            raise OneSidedError("nvlink: the transport is not running (closed, or its constructor failed)")
        self.lib.mt_nvl_error(self._h, self._err)
        return list(self._err)

    def _clear_native(self) -> int:
        if self._h is None:
            raise OneSidedError("nvlink: the transport is not running (closed, or its constructor failed)")
        return int(self.lib.mt_nvl_clear_error(self._h))

    def _release_native(self) -> list[str]:
        h, self._h = self._h, None
        native, self._native = self._native, None
        if native is not None:
            return run_now(native)  # _destroy_nvl_native, once
        # no finalizer: no context was made (or it was already destroyed)
        return _destroy_nvl_native(self.lib, h, loud=True) if h is not None else []


def _rows_in_place(t: torch.Tensor) -> bool:
    """Whether the kernels may read each row of the 2-D `t` as its bytes in place: adjacent columns, whatever the row
    count (a one-row tensor's column stride counts too: only its row stride does not), and rows that do not
    overlap."""
    return t.stride(1) == 1 and (t.shape[0] <= 1 or t.stride(0) >= t.shape[1])


def _destroy_nvl_native(lib: Any, h: ctypes.c_void_p, loud: bool = False) -> list[str]:
    """mt_nvl_destroy(h) (`destroy_native`)."""
    return destroy_native(lib, "mt_nvl_destroy", h, "nvlink transport", loud)
