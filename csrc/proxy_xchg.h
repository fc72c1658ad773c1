// moetune csrc: the GPU side of the proxy transport as plain functions (one CTA of 32 threads):
// thread 0 produces requests into the proxy engine's FIFO (count-matrix words, PUTs, signals, ACK),
// threads < world wait for what each source sent, thread 31 waits for the ACK of this rank's own
// transfers. Compiled by nvcc into the kernels of proxy_gpu.cu, and by g++ with MT_HOST_SIM (host
// stand-ins for the primitives, mt_common.h) so tests/test_onesided_cpu.py runs the SAME logic on CPU
// threads against the real proxy engine, over many iterations.
#pragma once

#include "proxy_engine.h"

namespace mtpx {

using mt::WaitCtx;

MT_DEV uint64_t tag_of(uint64_t n) { return ((n - 1) % 0xFFFFFEull) + 1; }

struct PxParams {
  MtGpuView v;
  uint64_t ctrl_local;
  uint64_t data_bytes;
  const char* send;
  uint64_t send_rows;  // rows of `send` (the send counts must stay within them)
  uint64_t row_bytes;
  const int64_t* send_counts;
  const int64_t* recv_counts;  // may be null
  int64_t* recv_out;           // exchange_counts output
  int rank, world, coupled, group, chunk_rows;
  uint64_t epoch;
  uint64_t* done;       // host-mapped completion word (null: none); written last with done_value
  uint64_t done_value;  // launch sequence number of this call
  WaitCtx w;
};

MT_DEV void chunking(long long cnt, int chunk_rows, long long* crow, int* nchunks) {
  if (cnt <= 0) {
    *crow = 1;
    *nchunks = 0;
    return;
  }
  long long c = chunk_rows > 0 ? chunk_rows : cnt;
  long long n = (cnt + c - 1) / c;
  if (n > MT_MAX_SLOTS) {
    c = (cnt + MT_MAX_SLOTS - 1) / MT_MAX_SLOTS;
    n = (cnt + c - 1) / c;
  }
  *crow = c;
  *nchunks = (int)n;
}

MT_DEV int ngroups(int nchunks, int g) {
  if (nchunks <= 0) return 0;
  if (g <= 0) return 1;
  return (nchunks + g - 1) / g;
}

struct Producer {
  const PxParams* p;
  uint64_t cached_tail;
  bool ok;
  AckSet* acks;  // the streams this call's pushes pick (the engine writes its ACK on exactly those), or null
  bool sent = false;  // a PUT that reads `send` is in the FIFO: from then on a full FIFO is waited out up to the
                      // timeout even after an abort (a push that gives up leaves its claimed slot unwritten, so the
                      // engine never reaches the ACK, and the call could return while those PUTs still read `send`)

  MT_DEV void push(uint32_t op, uint32_t peer, uint32_t flags, uint32_t sig_idx, uint64_t src, uint64_t dst_off,
                   uint64_t bytes, uint64_t value) {
    if (!ok) return;
    const MtGpuView& v = p->v;
    uint64_t slot = mt::atomic_add_u64(v.head_dev, 1ull);
    if (slot - cached_tail >= v.nslots) {
      uint64_t t0 = mt::now_ns();
      for (;;) {
        cached_tail = mt::ld_volatile(v.tail_dev);
        if (slot - cached_tail < v.nslots) break;
        if (mt::now_ns() - t0 > p->w.timeout_ns || (!sent && *(volatile int*)p->w.abort_flag)) {
          mt::report(p->w, MT_ERR_FIFO_FULL, (int)peer, (int)(slot % v.nslots), p->epoch, cached_tail, slot);
          ok = false;
          return;
        }
        mt::spin_pause();
      }
    }
    volatile uint64_t* d = reinterpret_cast<volatile uint64_t*>(v.fifo_dev + (slot % v.nslots));
    d[0] = (uint64_t)op | ((uint64_t)peer << 32);
    d[1] = (uint64_t)flags | ((uint64_t)sig_idx << 32);
    d[2] = src;
    d[3] = dst_off;
    d[4] = bytes;
    d[5] = value;
    d[6] = 0;
    mt::fence_system();
    d[7] = slot + 1;    // ready flag last
    mt::fence_system();  // push the ready flag out now: the thread may spin next (never leave it buffered)
    if (op == MT_OP_PUT && bytes > 0) sent = true;
    if (acks != nullptr && peer < MT_MAX_WORLD) {  // mirror Engine::pick (csrc/proxy_engine.cpp)
      if (op == MT_OP_WRITE64) acks->q[peer] |= 1ull;  // count words: the peer's first stream
      if (op == MT_OP_SIGNAL) pick(peer, sig_idx);
      if (op == MT_OP_PUT) {
        pick(peer, sig_idx);
        if (flags & MT_F_SIGNAL) pick(peer, sig_idx);  // its signal picks again (round_robin: the next stream)
      }
    }
  }

  MT_DEV void pick(uint32_t peer, uint32_t idx) {
    const int qps = p->v.qps;
    int k = 0;
    if (qps > 1)
      k = p->v.qp_mapping == MT_QP_PEER_HASH ? (int)(idx % (uint32_t)qps) : (int)(acks->rr[peer]++ % (uint32_t)qps);
    acks->q[peer] |= 1ull << k;
  }
};

// Thread 0 of the exchange: count-matrix rows, offsets, PUTs and signals, then the ACK. Returns whether the ACK
// went into the FIFO: it does whenever the FIFO takes requests, also after a failed wait ended the PUTs early (the
// PUTs already pushed still read `send`; thread 31 must be able to wait for them), and after a refusal (it covers
// the row's count words). False when a push gave up on a full FIFO (MT_ERR_FIFO_FULL reported): before any PUT on
// the abort flag (nothing reads `send`), after one only on the timeout (the engine stuck that long; nothing can
// confirm the PUTs before it).
// `acks` (zeroed here) gets the streams the pushes picked: thread 31 waits for the ACK on those. `refused` (set here):
// this rank refused its send counts (MT_ERR_SEND_COUNTS), so its lanes wait for the count words only.
MT_DEV bool produce_exchange(const PxParams& p, AckSet* acks, bool* refused) {
  const int par = (int)(p.epoch & 1);
  const uint64_t tag = tag_of(p.epoch);
  const uint64_t* mat = reinterpret_cast<const uint64_t*>(p.ctrl_local + MT_OFF_MAT);
  for (int i = 0; i < MT_MAX_WORLD; ++i) acks->q[i] = 0, acks->rr[i] = 0;
  // The caller's counts against its send rows (mt::send_counts_fit): refused before any PUT. The row still goes out,
  // every word marked MT_COUNT_REFUSED with this call's tag: the peers' waits for it end at once (they report
  // MT_ERR_PEER_REFUSED and send this rank nothing) instead of at their count-word timeout, and every rank still sees
  // every rank's word of this call, which the parity protocol needs (mt::report_refusal): after the call each rank
  // is one call further, as after a good one.
  *refused = !mt::send_counts_fit(p.w, p.send_counts, p.world, p.send_rows, p.epoch, true);
  Producer pr{&p, 0, true, acks};
  // my count-matrix row to every rank (immediate 8-byte writes through the proxy)
  for (int q = 0; q < p.world; ++q)
    for (int col = 0; col < p.world; ++col)
      pr.push(MT_OP_WRITE64, q, 0, 0, 0, MT_OFF_MAT + 8ull * ((size_t)(par * MT_MAX_WORLD + p.rank) * MT_MAX_WORLD + col),
              0, *refused ? mt::tagged_refused(tag) : mt::tagged(tag, (uint64_t)p.send_counts[col]));
  if (*refused) {  // no PUT, no signal: the ACK makes the call wait until its count words have been written
    pr.push(MT_OP_ACK, 0, 0, 0, 0, 0, 0, p.epoch);
    return pr.ok;
  }
  long long src_off = 0;
  for (int d = 0; d < p.world && pr.ok; ++d) {  // pr.ok false: the FIFO stayed full (reported)
    const long long cnt = p.send_counts[d];
    long long dst_rows = 0;
    bool ok = true;
    bool d_refused = false;  // d's row is marked: d refused its counts, receives nothing and waits for no signal
    for (int s = 0; s < p.rank && ok; ++s) {
      uint64_t v = mt::wait_word(p.w, mat + ((size_t)(par * MT_MAX_WORLD + s) * MT_MAX_WORLD + d), tag, false,
                                 MT_ERR_TIMEOUT_COUNTS, s, d, &ok);
      dst_rows += (long long)(v & MT_COUNT_MASK);  // a refusing rank's word: 0 rows (it sends none)
      if (s == d && mt::is_refused(v)) d_refused = true;  // d < rank: its own word is among these
    }
    // d has entered this call: its readers of the area we write (output of call epoch-2) are done
    if (ok && d >= p.rank)
      d_refused = mt::is_refused(mt::wait_word(p.w, mat + ((size_t)(par * MT_MAX_WORLD + d) * MT_MAX_WORLD), tag, false,
                                               MT_ERR_TIMEOUT_COUNTS, d, -3, &ok));
    if (!ok) break;  // no more PUTs; the ACK below still covers those pushed
    if (d_refused) {  // nothing to d (our lane d reports the refusal)
      src_off += cnt;
      continue;
    }
    // a sender of no rows overflows nothing: only the receiver (its own lane) reports what the others sent it
    const bool fits = cnt == 0 || (uint64_t)(dst_rows + cnt) * p.row_bytes <= p.data_bytes;
    if (!fits)
      mt::report(p.w, MT_ERR_CAPACITY, d, (int)cnt, p.epoch, (uint64_t)(dst_rows + cnt), p.data_bytes / p.row_bytes);
    long long crow;
    int nch;
    chunking(cnt, p.chunk_rows, &crow, &nch);
    const int g = p.group <= 0 ? nch : p.group;
    for (int c = 0; c < nch; ++c) {
      const long long r0 = (long long)c * crow;
      const long long rows = (cnt - r0) < crow ? (cnt - r0) : crow;
      // signal_idx: the slot of the signal that covers this PUT (coupled: its own; decoupled: its group's), so the
      // engine's peer_hash mapping keeps them on one stream (what nic_ordered needs)
      pr.push(MT_OP_PUT, d, p.coupled ? MT_F_SIGNAL : 0, p.coupled ? c : c / g,
              (uint64_t)(p.send + (uint64_t)(src_off + r0) * p.row_bytes),
              (uint64_t)par * p.data_bytes + (uint64_t)(dst_rows + r0) * p.row_bytes,
              fits ? (uint64_t)rows * p.row_bytes : 0, p.epoch);
      if (!p.coupled && ((c + 1) % g == 0 || c == nch - 1)) pr.push(MT_OP_SIGNAL, d, 0, c / g, 0, 0, 0, p.epoch);
    }
    src_off += cnt;
  }
  pr.push(MT_OP_ACK, 0, 0, 0, 0, 0, 0, p.epoch);
  return pr.ok;
}

// The lane that checks the receive capacity (below): past every source lane (world <= MT_MAX_WORLD < 30).
constexpr int kCapacityLane = 30;
static_assert(MT_MAX_WORLD < kCapacityLane, "the capacity lane must not be a source lane");

// The receiver's own capacity check (mt::check_receive_capacity): several senders that each fit can together overflow
// this rank, whose call would then return with their skipped rows missing.
MT_DEV void check_receive_capacity(const PxParams& p) {
  bool ok = true;
  mt::check_receive_capacity(p.w, reinterpret_cast<const uint64_t*>(p.ctrl_local + MT_OFF_MAT), (int)(p.epoch & 1),
                             p.rank, p.world, tag_of(p.epoch), p.epoch, p.data_bytes / p.row_bytes, &ok);
}

// Lane t of the exchange after the producer: t < world waits for source t's count and signals;
// t == kCapacityLane checks that what all sources send fits this rank's area;
// t == 31 waits until this rank's own transfers completed (the send rows may be reused afterwards): for the ACK
// (acked: produce_exchange's result), up to its own timeout even when another lane (a capacity or count error, a
// peer's timeout) raised the abort flag -- the engine still processes the ACK, and the call must not return while
// its PUTs may still read `send` (a caller that catches the error reuses it at once).
// refused (produce_exchange's): this rank refused its send counts; its lanes < world still wait for every source's
// word of this call (the proof that each peer entered it: mt::report_refusal says why), then for nothing more.
// A source whose word is marked refused sends nothing: its lane reports MT_ERR_PEER_REFUSED and waits for no signal.
MT_DEV void wait_exchange_lane(const PxParams& p, int t, bool acked, const AckSet& acks, bool refused) {
  const int par = (int)(p.epoch & 1);
  const uint64_t tag = tag_of(p.epoch);
  const uint64_t* mat = reinterpret_cast<const uint64_t*>(p.ctrl_local + MT_OFF_MAT);
  bool ok = true;
  if (t < p.world) {
    uint64_t v = mt::wait_word(p.w, mat + ((size_t)(par * MT_MAX_WORLD + t) * MT_MAX_WORLD + p.rank), tag, false,
                               MT_ERR_TIMEOUT_COUNTS, t, -1, &ok);
    if (!ok || refused) return;  // refused: nobody sends this rank rows in this call
    if (mt::is_refused(v)) {
      mt::report_refusal(p.w, MT_ERR_PEER_REFUSED, t, -1, p.epoch, 0, 0);
      return;
    }
    const long long cnt = (long long)(v & MT_COUNT_MASK);
    if (p.recv_counts != nullptr && cnt != p.recv_counts[t])
      mt::report(p.w, MT_ERR_COUNT_MISMATCH, t, 0, p.epoch, (uint64_t)cnt, (uint64_t)p.recv_counts[t]);
    long long crow;
    int nch;
    chunking(cnt, p.chunk_rows, &crow, &nch);
    const int nsig = p.coupled ? nch : ngroups(nch, p.group);
    const uint64_t* sig = reinterpret_cast<const uint64_t*>(p.ctrl_local + MT_OFF_SIG) + (size_t)t * MT_MAX_SLOTS;
    for (int k = 0; k < nsig && ok; ++k) mt::wait_word(p.w, sig + k, p.epoch, true, MT_ERR_TIMEOUT_SIGNAL, t, k, &ok);
  } else if (t == kCapacityLane && !refused) {  // refused: nothing comes to this rank
    check_receive_capacity(p);
  } else if (t == 31 && acked) {
    // the streams this call's requests picked (the engine writes the ACK on those; every stream if it failed)
    for (int peer = 0; peer < p.world && ok; ++peer)
      for (int k = 0; k < p.v.qps && ok; ++k)
        if ((acks.q[peer] >> k) & 1ull) {
          const int q = peer * p.v.qps + k;
          mt::wait_word(p.w, p.v.ack_dev + q, p.epoch, true, MT_ERR_TIMEOUT_OUTGOING, -1, q, &ok, false);
        }
  }
}

MT_DEV void produce_counts(const PxParams& p) {
  const int par = (int)(p.epoch & 1);
  const uint64_t tag = tag_of(p.epoch);
  Producer pr{&p, 0, true, nullptr};  // count words only: no ACK
  for (int q = 0; q < p.world; ++q)
    pr.push(MT_OP_WRITE64, q, 0, 0, 0, MT_OFF_CNT + 8ull * (par * MT_MAX_WORLD + p.rank), 0,
            mt::count_word(p.w, tag, p.send_counts[q], q, p.epoch));
}

MT_DEV void wait_counts_lane(const PxParams& p, int t) {
  if (t >= p.world) return;
  const int par = (int)(p.epoch & 1);
  const uint64_t tag = tag_of(p.epoch);
  bool ok = true;
  const uint64_t* mine = reinterpret_cast<const uint64_t*>(p.ctrl_local + MT_OFF_CNT) + par * MT_MAX_WORLD + t;
  uint64_t v = mt::wait_word(p.w, mine, tag, false, MT_ERR_TIMEOUT_COUNTS, t, -2, &ok);
  p.recv_out[t] = ok ? mt::counts_received(p.w, v, t, p.epoch) : 0;
}

// Last action of a call (after every lane finished): the host-mapped completion word.
MT_DEV void finish(const PxParams& p) {
  if (p.done == nullptr) return;
  mt::fence_system();
  mt::st_release_sys(p.done, p.done_value);
  mt::fence_system();
}

}  // namespace mtpx
