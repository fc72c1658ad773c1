// The decode kernel: the layer's expert work for a handful of routed rows in ONE launch of one CTA per SM.
// Included by mk_moe.cu inside its anonymous namespace (it uses that file's PTX helpers, bounded waits and error
// record); not a header of its own.
//
// Why a second kernel: at S = 1 the task graph's 16-row tiles compute 1 row in 16, its 96 GEMM1 tasks occupy 96
// SMs, and the down projection's weights stream only once the up projection is done (run 15-20 timelines: the
// GEMM1s at ~2.2 TB/s, 6 µs before the first task). Here every SM streams from the start:
//   0. (decode = 2) routing in the kernel: the S x E gate dot products spread over the CTAs (a warp each, fp32),
//      counted on one counter; every CTA then runs k_topk's warp selection (warp_topk) on the logits itself, so
//      all CTAs hold the same picks without another kernel. decode = 1 reads given picks (topk_idx / topk_w).
//   1. each CTA starts bulk copies of its R output rows of W_down[e] per slot (R x 64 bf16 per k plane, contiguous
//      in the k-tiled weight) into shared memory, on one mbarrier;
//   2. it computes its share of the S*K*I (gate, up) row pairs as dot products with x, items of 4 pairs x 8 k planes
//      per warp (fp32 accumulate, h = silu(gate) * up rounded to bf16 as the tile kernels store it) and adds the
//      pairs it finished to each slot's counter (release after the h stores);
//   3. once every slot's counter reaches I (acquire, bounded waits): out[t, r] = sum over the token's slots in
//      order of w[t, j] * (W_down row r . h) in fp32, then bf16; each lane reads its h chunks from the L2, and
//      the first k-rounds of its W_down rows were moved into registers while the CTA waited. Every output row is
//      written by exactly one CTA and the sums run in a fixed order: bit-identical runs.
// The counters are the kernel's own (MkParams.dec_cnt): the CTA that takes the last exit ticket zeroes them (and the
// launch's own abort flag, DEC_ABORT, which its waits poll instead of ctl's) and writes the launch's task counts into ctl (phase-1 ranges and phase-3 row blocks, as runtime/megakernel/decode.py
// models them), so a launch needs no reset kernel before it. All CTAs are resident (one per SM, checked by the
// occupancy query at launch), so a CTA waiting for a slot never blocks the CTAs that finish it.

// A streaming variant for launches whose slots' W_down rows do not all fit a CTA (S = 2..24 here: the up projection
// once per touched expert on mma tiles of 8 gate + 8 up rows x 8 tokens, then each CTA's W_down rows and h through a
// ring of shared-memory entries; 8f8595d..dd41351) was slower than the task graph at every S measured side by side
// (runs 94-97, graph µs: S=2 62.2 vs 59.4, 4 105.6 vs 95.9, 8 162.0 vs 138.2, 16 241.2 vs 199.7): its routing in the
// kernel took 11 µs to the picks at S=16, no less than the routing kernels under pdl, its up projection streamed at
// ~3.6-4.0 TB/s against the tile tasks' 4.2-4.3, and its phases met at a grid-wide wait. Dropped.

// Every loop of the kernel runs a few times per launch, most exactly once, so none is unrolled (smaller code; run 65
// against run 64: the same phase times, so the code size was not what made phase 3 slow, nor was warming it, run 68).
#define MK_ONCE _Pragma("unroll 1")
constexpr int DEC_THREADS = 512, DEC_WARPS = DEC_THREADS / 32;
constexpr int DEC_VEC = 8;  // 16-byte weight loads in flight per lane and row: a routing row's, or an item's k planes (phase 2)
#ifndef MK_DEC_PRE
#define MK_DEC_PRE 2
#endif
// phase 3's k-rounds of a warp's first unit held in registers (see phase 3; 2 and 3 alike in run 167, 3 takes all 128
// registers a thread of a 512-thread CTA may have)
constexpr int DEC_PRE = MK_DEC_PRE;
constexpr int DEC_MAX_SLOTS = 64;   // S*K rows a decode launch takes (routing in static shared memory)
// MkParams.dec_cnt: int32 counters one 128-byte line apart (polled by every CTA): slot s's finished pairs at
// DEC_STRIDE * s, the exit ticket; then the gate logits of in-kernel routing from word DEC_LOGIT0,
// each stored as the bitwise NOT of its fp32 bits, so the zero the launch finds there means "not written yet" (the
// NOT of a float the GPU's arithmetic produces is never zero: its NaNs are 0x7fffffff). DEC_ABORT, a word of the
// ticket's line (another 32-byte sector): the launch's abort flag, which its reports raise and its waits poll instead
// of ctl's MK_CTL_ABORT. Only the task graph's routing kernels lift that one (every launch), and no kernel runs before
// a decode launch, so an error of an earlier launch (k_lists' bad expert id, a task-graph timeout) left it raised and
// every later decode launch gave up every wait at once: NaN logits (not yet written) for routing, sums of h never
// completed, silently until clear_error. This word is zeroed with the counters by the CTA that takes the last exit
// ticket (after every CTA's last wait), so each launch starts with it lifted; the error record stays for check().
constexpr int DEC_STRIDE = 32, DEC_MAX_LOGITS = 4096;  // S x E a decode launch with routing takes
enum { DEC_CNT_TICKET = DEC_MAX_SLOTS, DEC_ABORT = DEC_STRIDE * DEC_CNT_TICKET + 16,
       DEC_LOGIT0 = (DEC_MAX_SLOTS + 1) * DEC_STRIDE, DEC_CNT_WORDS = DEC_LOGIT0 + DEC_MAX_LOGITS };
// Timeline (MkParams.trace, profiling only): words per CTA after MK_TR_HEAD, stamped by thread 0.
enum { DEC_TR_START = 0, DEC_TR_ROUTED = 1, DEC_TR_P1 = 2, DEC_TR_SIGNALLED = 3, DEC_TR_W2 = 4, DEC_TR_READY = 5,
       DEC_TR_H = 6, DEC_TR_SUMS = 7, DEC_TR_END = 8, DEC_TR_LOGITS = 9, DEC_TR_WORDS = 10 };
// Measurement builds (never the default): 1 = no W_down copies (phase 3 adds whatever shared memory holds),
// 2 = no up-projection loads (phase 2 multiplies zeros), 3 = neither; 4 (or-ed) = no down-projection sums; 16 = the
// kernel returns at entry (this launch shape with no work, timed side by side by megakernel_profile --vs-lib). (8,
// the top-k and the sums run twice to compare cold and warm code, was removed after run 75: 08b82fb has it.)
// Phase 3 on the tensor cores (mma.sync, 16 rows x 8 slots per mma, W_down rows laid out for conflict-free
// ldmatrix) was no faster: 37.3 vs 36.2 µs graph replay side by side (run 78; 1d264de has it). Nor was routing that
// ranks the softmax probabilities with a thread per (token, expert) instead of warp_topk's K rounds: 2.4 µs from the
// logits to the picks against 1.7, 36.8 vs 36.2 µs (run 80; cac9227 has it), nor (gate, up) pairs handed out by one
// launch-wide counter: 42.5 vs 36.2 µs, 2112 warps asking one address before their first loads (run 81; 089d10b
// has it), nor two pairs per warp by index and the rest by the counter: 39.3 vs 36.2 (run 82; 43b181e), nor each
// pair's h stored as its own polled word instead of the fenced slot counters and a reload (36.6 vs 36.3, runs 87-88;
// 776f23c): the slots were ready at the same time, gated by the last CTA's pairs.
#ifndef MK_DEC_PROBE
#define MK_DEC_PROBE 0
#endif

// Shared-memory layout of a decode launch (offsets in bytes into the dynamic shared memory) and its grid.
struct DecPlan {
  int grid, rows;  // CTAs (one per SM), output rows per CTA (ceil(H / grid))
  int pairs;  // the most (gate, up) row pairs a CTA takes: ceil(S * K * I / grid)
  int x_off, w2_off, acc_off, qpart_off, lg_off, part_off, bytes;
};
inline DecPlan dec_plan(int64_t S, int64_t H, int64_t I, int64_t K, int64_t E, int sms) {
  auto up = [](int64_t v) { return (v + 127) / 128 * 128; };
  DecPlan d = {};
  d.grid = sms;
  d.rows = (int)((H + sms - 1) / sms);
  const int64_t slots = S * K;
  const int64_t x_off = 128;  // [0, 8): the W_down copies' mbarrier
  const int64_t w2_off = up(x_off + S * H * 2);
  const int64_t acc_off = up(w2_off + slots * d.rows * I * 2);
  d.pairs = (int)((slots * I + sms - 1) / sms);
  const int64_t qpart_off = up(acc_off + S * d.rows * 4);  // phase 2's sums: (gate, up) per pair and plane batch
  const int64_t lg_off = up(qpart_off + (H / 64 + DEC_VEC - 1) / DEC_VEC * d.pairs * 8);  // the S x E logits
  const int64_t part_off = up(lg_off + S * E * 4);  // phase 3's per-slot sums of the CTA's rows
  const int64_t bytes = part_off + slots * d.rows * 4;
  if (bytes > (1ll << 30)) return d;  // bytes stays 0: does not fit
  d.x_off = (int)x_off, d.w2_off = (int)w2_off, d.acc_off = (int)acc_off;
  d.qpart_off = (int)qpart_off, d.lg_off = (int)lg_off, d.part_off = (int)part_off, d.bytes = (int)bytes;
  return d;
}

// 16 bytes of weights that this launch reads once: not kept in L1; with the L2 evict-first policy when asked.
__device__ __forceinline__ uint4 ld_weights(const uint4* p, bool evict_first, uint64_t pol) {
  uint4 v;
  if (evict_first)
    asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p), "l"(pol));
  else
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
  return v;
}
// One contiguous run of bytes (a multiple of 16, 16-byte aligned) into shared memory, counted on mbarrier `bar`.
__device__ __forceinline__ void bulk_load(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar,
                                          bool evict_first, uint64_t pol) {
  if (evict_first)
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;\n" ::
            "r"(dst),
        "l"(src), "r"(bytes), "r"(bar), "l"(pol)
        : "memory");
  else
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
                 "l"(src), "r"(bytes), "r"(bar)
                 : "memory");
}
// bf16 -> fp32 is the top half of the word: one shift or mask per element (the bf16 header's conversion of the
// upper element compiled to two instructions)
__device__ __forceinline__ float bf_lo(uint32_t u) { return __uint_as_float(u << 16); }
__device__ __forceinline__ float bf_hi(uint32_t u) { return __uint_as_float(u & 0xffff0000u); }
// the 8 bf16 of b widened (phase 3 widens one h chunk once for several rows)
__device__ __forceinline__ void widen8(float (&f)[8], const uint4 b) {
  const uint32_t y[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) f[2 * i] = bf_lo(y[i]), f[2 * i + 1] = bf_hi(y[i]);
}
// acc += the 8 products of bf16 a and widened f (fp32, in element order)
__device__ __forceinline__ void dot8f(float& acc, const uint4 a, const float (&f)[8]) {
  const uint32_t x[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    acc = fmaf(bf_lo(x[i]), f[2 * i], acc);
    acc = fmaf(bf_hi(x[i]), f[2 * i + 1], acc);
  }
}
// a[r] += W row r's 8 bf16 . the 8 of h, for the 8 rows of a phase-3 unit (h widened once)
__device__ __forceinline__ void dot_rows8(float (&a)[8], const uint4 (&w)[8], const uint4 h) {
  float hf[8];
  widen8(hf, h);
#pragma unroll
  for (int r = 0; r < 8; ++r) dot8f(a[r], w[r], hf);
}
// acc += the 8 bf16 products of a and b. By value: with references into shared memory nvcc read an operand as four
// 4-byte loads, a 4-way bank conflict each (run 69's excess wavefronts, found in run 70's per-line table)
__device__ __forceinline__ void dot8(float& acc, const uint4 a, const uint4 b) {
  float f[8];
  widen8(f, b);
  dot8f(acc, a, f);
}
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(~0u, v, o);
  return v;
}
__device__ __forceinline__ void dec_stamp(const MkParams& p, int f) {
  if (p.trace && threadIdx.x == 0) p.trace[MK_TR_HEAD + DEC_TR_WORDS * blockIdx.x + f] = (int64_t)gtime();
}
// A logit word of dec_cnt once written (non-zero), bounded like every wait: after timeout_ns it reports
// MK_ERR_INPUT_TIMEOUT (where = -2 - the logit's index) and returns what it last read: 0 (not written) when it timed
// out or the launch was aborted, which the caller takes as "no routing".
__device__ __forceinline__ int wait_logit(const MkParams& p, const int32_t* w, int i) {
  int v = ld_relaxed(w);
  if (v != 0) return v;
  const uint64_t since = gtime();
  while ((v = ld_relaxed(w)) == 0) {
    if (*(volatile int32_t*)&p.dec_cnt[DEC_ABORT]) break;
    const uint64_t waited = gtime() - since;
    if (waited > (uint64_t)p.timeout_ns) {
      report(p, MK_ERR_INPUT_TIMEOUT, -2 - i, 0, (int64_t)waited, p.dec_cnt + DEC_ABORT);
      break;
    }
  }
  return v;
}
__device__ __forceinline__ int atom_add_acq_rel(int32_t* p, int v) {
  int old;
  asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;\n" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}
__device__ __forceinline__ void red_release(int32_t* p, int v) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}

// NI: experts per lane of the in-kernel top-k (as k_topk's template bound)
template <int NI>
__global__ void __launch_bounds__(DEC_THREADS, 1) k_decode(const MkParams p, const DecPlan d) {
  extern __shared__ __align__(128) char smem[];
  __shared__ int s_e[DEC_MAX_SLOTS];
  __shared__ float s_w[DEC_MAX_SLOTS];
  __shared__ int s_failed;  // a logit wait of this CTA gave up (decode = 2), or the launch was aborted by its ticket
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int S = (int)p.S, K = (int)p.K, H = (int)p.H, I = (int)p.I, E = (int)p.E, slots = S * K;
  const uint32_t bar = su32(smem);
  bf16* xs = (bf16*)(smem + d.x_off);
  const char* w2s = smem + d.w2_off;
  float* acc = (float*)(smem + d.acc_off);
  float* qpart = (float*)(smem + d.qpart_off);  // phase 2's (gate, up) sums: [plane batch][pair][2]
  float* lg = (float*)(smem + d.lg_off);
  float* part = (float*)(smem + d.part_off);
  int32_t* cnt = p.dec_cnt;
  int32_t* const dab = cnt + DEC_ABORT;  // this launch's abort flag (every wait and report of the kernel)
  const int r0 = blockIdx.x * d.rows, nr = max(0, min(d.rows, H - r0));  // this CTA's output rows
  const bool ev = p.l2_evict_w != 0;
  uint64_t pol = 0;
  if (ev) asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(pol));
  if (MK_DEC_PROBE & 16) return;
  dec_stamp(p, DEC_TR_START);
  if (tid == 0) {
    s_failed = 0;
    mbar_init(bar, 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  const int HV = H / 8;  // 16-byte vectors per weight row
  // routing's gate logits (t, e) of [l0, l1), a warp each: the first chunk of each warp's first gate row is loaded
  // before pdl_enter (weights, which no kernel before writes), so its DRAM latency overlaps x's
  const int L = S * E, l0 = (int)((int64_t)L * blockIdx.x / gridDim.x), l1 = (int)((int64_t)L * (blockIdx.x + 1) / gridDim.x);
  uint4 gpre[DEC_VEC];
  {
    const uint4* g = (const uint4*)((const bf16*)p.wg + (int64_t)((l0 + warp) % E) * H);
#pragma unroll
    for (int i = 0; i < DEC_VEC; ++i) {
      const int v = lane + 32 * i;
      gpre[i] = p.decode == 2 && l0 + warp < l1 && v < HV ? ld_weights(g + v, false, pol) : make_uint4(0, 0, 0, 0);
    }
  }
  pdl_enter(p);  // x (and given picks) from the kernels before are visible from here
  MK_ONCE for (int v = tid; v < S * H / 8; v += DEC_THREADS) ((uint4*)xs)[v] = ((const uint4*)p.x)[v];
  __syncthreads();
  bool failed = false;  // (CTA-uniform) no picks: every slot -1, nothing read or computed, the rows written NaN;
                        // at the output, also set where the launch was aborted before this CTA's exit ticket
  if (p.decode == 2) {
    // 0. the logits, then the picks from all of them in every CTA
    MK_ONCE for (int l = l0 + warp; l < l1; l += DEC_WARPS) {
      const uint4* g = (const uint4*)((const bf16*)p.wg + (int64_t)(l % E) * H);
      const uint4* xv = (const uint4*)(xs + (int64_t)(l / E) * H);
      float a = 0.f;
      MK_ONCE for (int v0 = 0; v0 < HV; v0 += 32 * DEC_VEC) {  // the row's loads in flight at once (run 66: one
        uint4 w[DEC_VEC];                                        // at a time, routing took 8 µs)
        const bool pre = l == l0 + warp && v0 == 0;
#pragma unroll
        for (int i = 0; i < DEC_VEC; ++i) {
          const int v = v0 + lane + 32 * i;
          w[i] = pre ? gpre[i] : v < HV ? ld_weights(g + v, false, pol) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int i = 0; i < DEC_VEC; ++i)
          if (v0 + lane + 32 * i < HV) dot8(a, w[i], xv[v0 + lane + 32 * i]);
      }
      a = warp_sum(a);
      if (lane == 0) {
        p.logits[l] = a;  // the layer's routing buffer, as k_logits leaves it
        st_relaxed(cnt + DEC_LOGIT0 + l, ~__float_as_int(a));
      }
    }
    // every logit polled where it lands (one L2 round trip; a counter of written logits and a reload after it took
    // two, run 71's timeline)
    MK_ONCE for (int i = tid; i < L; i += DEC_THREADS) {
      const int v = wait_logit(p, cnt + DEC_LOGIT0 + i, i);
      if (v == 0) s_failed = 1;  // timed out or aborted: ~0 would be a NaN logit that no kernel computed
      lg[i] = __int_as_float(~v);
    }
    __syncthreads();
    failed = s_failed != 0;
    dec_stamp(p, DEC_TR_LOGITS);
    MK_ONCE for (int t = warp; t < S; t += DEC_WARPS) {
      int e = -1, bad = -1;
      float w = 0.f;
      // a CTA whose logit wait gave up routes nothing (the launch is aborted and its error recorded): its picks stay
      // -1, so no pick comes from a logit that was never written, and no weight is read for one
      if (!failed) warp_topk<NI>(lg + (int64_t)t * E, E, K, lane, e, w, bad);
      if (blockIdx.x == 0 && lane == 0) note_nonfinite(p, t, bad);  // not aborted: the picks are valid experts
      if (lane < K && !failed && (e < 0 || e >= E)) {  // never from the selection; a bug in it reads no weights past W
        if (blockIdx.x == 0) report(p, MK_ERR_BAD_EXPERT, t * K + lane, e, 0, dab);
        e = -1;  // the slot adds nothing (as given picks out of range)
      }
      if (lane < K) {
        s_e[t * K + lane] = e;
        s_w[t * K + lane] = w;
        if (blockIdx.x == 0) {  // the layer's routing() reads them
          p.topk_idx[t * K + lane] = e;
          p.topk_w[t * K + lane] = w;
        }
      }
    }
  } else {
    MK_ONCE for (int s = tid; s < slots; s += DEC_THREADS) {
      int e = __ldcg(p.topk_idx + s);
      if (e < 0 || e >= E) {
        if (blockIdx.x == 0) report(p, MK_ERR_BAD_EXPERT, s, e, 0, dab);
        e = -1;  // the slot adds nothing (as k_lists drops the row)
      }
      s_e[s] = e;
      s_w[s] = __ldcg(p.topk_w + s);
    }
  }
  __syncthreads();
  dec_stamp(p, DEC_TR_ROUTED);
  const int64_t P = (int64_t)slots * I;
  const int64_t q0 = P * blockIdx.x / gridDim.x, q1 = P * (blockIdx.x + 1) / gridDim.x;
  // 1. this CTA's rows of W_down for every slot, in flight while phase 2 streams the up projection. W_down is
  // k-tiled ([I / 64][E * H][64], mk_api.h): rows r0.. of plane kt are one contiguous run of nr x 128 bytes, copied to
  // plane kt of the slot's [I / 64][d.rows][64] in shared memory; warp 0's lanes share the slots x I / 64 copies
  // (lane 0 sets the byte count first).
  const int KP = I / 64;  // k planes
  if (warp == 0 && nr > 0) {
    if (lane == 0) {
      uint32_t bytes = 0;
      MK_ONCE for (int s = 0; s < slots; ++s) bytes += s_e[s] >= 0 && !(MK_DEC_PROBE & 1) ? (uint32_t)nr * I * 2 : 0;
      mbar_arrive_tx(bar, bytes);
    }
    __syncwarp();
    MK_ONCE for (int c = lane; c < slots * KP; c += 32) {
      const int s = c / KP, kt = c % KP;
      if (s_e[s] >= 0 && !(MK_DEC_PROBE & 1))
        bulk_load(su32(w2s) + (uint32_t)(s * d.rows * I + kt * d.rows * 64) * 2,
                  (const bf16*)p.w2 + ((int64_t)kt * E * H + (int64_t)s_e[s] * H + r0) * 64, (uint32_t)nr * 128, bar,
                  ev, pol);
    }
  }
  dec_stamp(p, DEC_TR_P1);
  // 2. (gate, up) row pairs [q0, q1) of the S*K*I. W_gate_up is k-tiled ([H / 64][E * 2I][64], mk_api.h): in each k
  // plane the range's consecutive gate rows (and up rows) are consecutive 128-byte runs. An item is 4 consecutive
  // pairs x DEC_VEC planes: lane 8 r + c loads chunk c of each plane of pair r's gate and up rows, so every load
  // instruction reads 512 contiguous bytes of each matrix (a warp per pair read one 128-byte run from each of 4 planes
  // 25 MB apart: 1.8 µs slower at S=1, run 160). The 8 lanes of a pair sum its batch of planes into qpart; the pair's
  // h is formed after the barrier below. Thread 0's copy instructions return only as the copy engine takes them (up
  // to 8 µs into the launch in run 63's timeline), so warp 0 starts late as it returns: warps 1.. take R2 = ceil(items
  // / warps) items each, warp 0 the rest (at most R2).
  const int n2 = (int)(q1 - q0), NB = (H / 64 + DEC_VEC - 1) / DEC_VEC;  // batches of DEC_VEC planes
  const int items = (n2 + 3) / 4 * NB, R2 = (items + DEC_WARPS - 1) / DEC_WARPS;
  const int i_lo = warp ? warp - 1 : (DEC_WARPS - 1) * R2, i_step = warp ? DEC_WARPS - 1 : 1;
  const int i_hi = warp ? min(items, (DEC_WARPS - 1) * R2) : items;
  const int64_t plane = (int64_t)E * 2 * I * 8;  // 16-byte chunks between k planes
  const int c = lane & 7;
  MK_ONCE for (int it = i_lo; it < i_hi; it += i_step) {
    const int pr = it / NB * 4 + (lane >> 3), kt0 = it % NB * DEC_VEC;  // this lane's pair in the range, first plane
    const int64_t q = q0 + pr;
    const int s = pr < n2 ? (int)(q / I) : 0, e = pr < n2 ? s_e[s] : -1;
    float ag = 0.f, au = 0.f;
    if (e >= 0) {
      const uint4* g = (const uint4*)p.w1 + ((int64_t)e * 2 * I + q % I) * 8 + c + kt0 * plane;
      const uint4* u = g + (int64_t)I * 8;  // the up row: I rows further
      const uint4* xv = (const uint4*)(xs + (int64_t)(s / K) * H) + c + kt0 * 8;
      const int np = min(DEC_VEC, H / 64 - kt0);
      uint4 a[DEC_VEC], b[DEC_VEC];
#pragma unroll
      for (int i = 0; i < DEC_VEC; ++i) {  // every load issued before the first product
        a[i] = i < np && !(MK_DEC_PROBE & 2) ? ld_weights(g + i * plane, ev, pol) : make_uint4(0, 0, 0, 0);
        b[i] = i < np && !(MK_DEC_PROBE & 2) ? ld_weights(u + i * plane, ev, pol) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int i = 0; i < DEC_VEC; ++i)
        if (i < np) {
          const uint4 xx = xv[i * 8];
          dot8(ag, a[i], xx);
          dot8(au, b[i], xx);
        }
    }
#pragma unroll
    for (int o = 1; o < 8; o <<= 1) {  // the pair's 8 lanes
      ag += __shfl_xor_sync(~0u, ag, o);
      au += __shfl_xor_sync(~0u, au, o);
    }
    if (c == 0 && pr < n2) reinterpret_cast<float2*>(qpart)[it % NB * d.pairs + pr] = make_float2(ag, au);
  }
  if (p.trace && tid == 0 && nr > 0) {  // timeline only: when the W_down copies landed (or warp 0's pairs were done)
    mbar_wait(p, bar, 0, (uint32_t)blockIdx.x, dab);
    dec_stamp(p, DEC_TR_W2);
  }
  __syncthreads();
  // the range's h elements are contiguous in h (pair q is h[q]): whole lines, not one 2-byte store per pair
  MK_ONCE for (int pr = tid; pr < n2; pr += DEC_THREADS) {
    // a slot that adds nothing: no h. A CTA whose logit wait gave up has every slot -1, so it stores no h, yet its
    // thread 0 still signals its pairs below: a CTA that got every logit can then see a slot's count complete over h
    // this launch never wrote (the last launch's). That CTA raised or saw the abort before signalling, so every CTA
    // reads the flag before its exit ticket and writes its rows NaN where it is set (phase 3's end).
    if (s_e[(int)((q0 + pr) / I)] < 0) continue;
    float2 gu = make_float2(0.f, 0.f);
    MK_ONCE for (int b = 0; b < NB; ++b) {
      const float2 v = reinterpret_cast<const float2*>(qpart)[b * d.pairs + pr];
      gu.x += v.x;
      gu.y += v.y;
    }
    ((bf16*)p.h)[q0 + pr] = __float2bfloat16(__fdividef(gu.x, 1.f + __expf(-gu.x)) * gu.y);
  }
  __syncthreads();  // every thread's h stores before thread 0's fence and counters
  // The exit ticket: the CTA that takes the last one is past every CTA's last counter access (each takes it after its
  // own: its signals, and an owner's slot waits), so it zeroes the counters for the next launch. Taken early and its
  // value read only at the end, the round trip overlaps phase 3 (a fence and a ticket after the last stamp, then a
  // fence and an exchange in the last CTA, cost ~2 µs past the sums in run 71).
  int ticket = 0;
  if (tid == 0) {
    if (q1 > q0) {
      __threadfence();
      MK_ONCE for (int s = (int)(q0 / I); s <= (int)((q1 - 1) / I); ++s) {
        const int64_t lo = q0 > (int64_t)s * I ? q0 : (int64_t)s * I;
        const int64_t hi = q1 < (int64_t)(s + 1) * I ? q1 : (int64_t)(s + 1) * I;
        red_release(cnt + DEC_STRIDE * s, (int)(hi - lo));
      }
    }
    if (nr == 0) ticket = atom_add_acq_rel(cnt + DEC_STRIDE * DEC_CNT_TICKET, 1);
  }
  dec_stamp(p, DEC_TR_SIGNALLED);
  if (nr > 0) {
    // 3. the down projection of this CTA's rows once every slot's h is complete: one thread polls each slot's
    // counter (all at once: slot by slot, a poll, an h load and two barriers each took 12 µs for 8 slots in run
    // 62), then each warp sums its (token, row)s
    mbar_wait(p, bar, 0, (uint32_t)blockIdx.x, dab);
    // a warp per (slot, 8 rows): each lane walks whole 16-byte chunks of k (KV / 32 rounds, no idle lanes), its h
    // chunk widened once for the 8 rows, the 8 rows' loads issued before their products; then one butterfly leaves
    // each row's sum on 4 lanes (9 shuffles for 8 rows instead of 40). Run 70's ncu: the sums were issue-bound
    // (~1,180 instructions a warp, half-idle second rounds, 80 shuffles a warp).
    // The first DEC_PRE rounds of the warp's first unit read their W_down rows from shared memory into registers
    // here, while the CTA waits for the slots (at S=1 its 196 KB of W_down rows are ~0.8 µs of shared-memory
    // bandwidth); each lane's h chunks come straight from the L2 (lane v only reads chunk v of its slot), not
    // through a CTA-wide copy and its barrier. Run 167, S=1 side by side: the sums done ~1.95 µs after "ready"
    // instead of ~2.8, a forward 0.5 µs (single replays) / 0.6 µs (chains) faster; the same sums in the same order.
    const int RB = (nr + 7) / 8, units = slots * RB, KV = I / 8;
    uint4 wpre[DEC_PRE][8];
    const bool pre = warp < units && !(MK_DEC_PROBE & 4);
    if (pre) {
      const int s = warp / RB, rb = (warp % RB) * 8;
      const uint4* wr = (const uint4*)(w2s + (int64_t)s * d.rows * I * 2);
#pragma unroll
      for (int j = 0; j < DEC_PRE; ++j) {
        const int v = lane + 32 * j;
#pragma unroll
        for (int r = 0; r < 8; ++r)
          wpre[j][r] = v < KV ? wr[((v >> 3) * d.rows + min(rb + r, nr - 1)) * 8 + (v & 7)] : make_uint4(0, 0, 0, 0);
      }
    }
    if (tid < slots && s_e[tid] >= 0) wait_count(p, cnt + DEC_STRIDE * tid, I, tid == p.stall_tile, tid, dab);
    __syncthreads();
    if (tid == 0) {
      // aborted: a wait of this CTA gave up, or a count may have completed over a failed CTA's pairs (no h stored;
      // it raised the flag before its release, which this CTA's acquire saw): the rows are written NaN below, never
      // finite sums of h that was not computed. Read before the ticket: the last ticket's CTA lifts the flag.
      if (*(volatile int32_t*)dab) s_failed = 1;
      ticket = atom_add_acq_rel(cnt + DEC_STRIDE * DEC_CNT_TICKET, 1);
    }
    dec_stamp(p, DEC_TR_READY);
    dec_stamp(p, DEC_TR_H);  // (no CTA-wide h copy: each lane loads its own chunks below)
    // unit u's rounds from v0 on (W_down rows from shared memory), then the butterfly: a[i] -> the warp's sum of row
    // rb + 4 b4 + 2 b3 + b2 (b_k: lane bit k), on the lanes with b1 = b0 = 0, stored to part
    auto unit_sums = [&](int u, float(&a)[8], int v0) {
      const int s = u / RB, rb = (u % RB) * 8;
      const uint4* hg = (const uint4*)p.h + (int64_t)s * KV;  // written by other CTAs: __ldcg, after the barrier
      const uint4* wr = (const uint4*)(w2s + (int64_t)s * d.rows * I * 2);
      MK_ONCE for (int v = v0; v < KV; v += 32) {  // rows past nr reread the last; their sums are dropped
        const uint4 hc = __ldcg(hg + v);
        uint4 w[8];
#pragma unroll
        for (int r = 0; r < 8; ++r) w[r] = wr[((v >> 3) * d.rows + min(rb + r, nr - 1)) * 8 + (v & 7)];  // k planes
        dot_rows8(a, w, hc);
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const bool up = lane & 16;
        const float send = up ? a[i] : a[i + 4];
        a[i] = (up ? a[i + 4] : a[i]) + __shfl_xor_sync(~0u, send, 16);
      }
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const bool up = lane & 8;
        const float send = up ? a[i] : a[i + 2];
        a[i] = (up ? a[i + 2] : a[i]) + __shfl_xor_sync(~0u, send, 8);
      }
      {
        const bool up = lane & 4;
        const float send = up ? a[0] : a[1];
        a[0] = (up ? a[1] : a[0]) + __shfl_xor_sync(~0u, send, 4);
      }
      a[0] += __shfl_xor_sync(~0u, a[0], 2);
      a[0] += __shfl_xor_sync(~0u, a[0], 1);
      const int row = rb + ((lane >> 4) & 1) * 4 + ((lane >> 3) & 1) * 2 + ((lane >> 2) & 1);
      if ((lane & 3) == 0 && row < nr) part[s * d.rows + row] = a[0];
    };
    if (pre && s_e[warp / RB] >= 0) {  // the warp's first unit: the rounds held in registers first
      const uint4* hg = (const uint4*)p.h + (int64_t)(warp / RB) * KV;
      uint4 hq[DEC_PRE];
#pragma unroll
      for (int j = 0; j < DEC_PRE; ++j)
        hq[j] = lane + 32 * j < KV ? __ldcg(hg + lane + 32 * j) : make_uint4(0, 0, 0, 0);
      float a[8];
#pragma unroll
      for (int r = 0; r < 8; ++r) a[r] = 0.f;
#pragma unroll
      for (int j = 0; j < DEC_PRE; ++j)
        if (lane + 32 * j < KV) dot_rows8(a, wpre[j], hq[j]);
      unit_sums(warp, a, lane + 32 * DEC_PRE);
    }
    MK_ONCE for (int u = warp + DEC_WARPS; u < units && !(MK_DEC_PROBE & 4); u += DEC_WARPS) {
      if (s_e[u / RB] < 0) continue;
      float a[8];
#pragma unroll
      for (int r = 0; r < 8; ++r) a[r] = 0.f;
      unit_sums(u, a, lane);
    }
    __syncthreads();
    MK_ONCE for (int i = tid; i < S * nr && !(MK_DEC_PROBE & 4); i += DEC_THREADS) {
      const int t = i / nr, r = i % nr;
      float y = 0.f;
      MK_ONCE for (int s = t * K; s < (t + 1) * K; ++s)
        if (s_e[s] >= 0) y = fmaf(s_w[s], part[s * d.rows + r], y);
      acc[t * d.rows + r] = y;
    }
    dec_stamp(p, DEC_TR_SUMS);  // (thread 0's share of the sums done)
    __syncthreads();
    failed = s_failed != 0;  // thread 0 set it before the barrier above, where the launch was aborted
    bf16* out = (bf16*)p.out;
    // a CTA without picks or of an aborted launch (failed) marks its rows not computed: NaN, never a sum that looks
    // like an output
    MK_ONCE for (int i = tid; i < S * nr; i += DEC_THREADS)
      out[(int64_t)(i / nr) * H + r0 + i % nr] = __float2bfloat16(failed ? __int_as_float(0x7fffffff)
                                                                          : acc[(i / nr) * d.rows + i % nr]);
  }
  dec_stamp(p, DEC_TR_END);
  // the last ticket: the counters zeroed, and the launch's task counts where the task graph's scheduler leaves them
  // (a task per CTA with pairs, min(P, grid), and per CTA with rows; as runtime/megakernel/decode.py counts them)
  if (tid == 0 && ticket == (int)gridDim.x - 1) {
    const int tasks = (int)min(P, (int64_t)gridDim.x) + min((int)gridDim.x, (H + d.rows - 1) / d.rows);
    p.ctl[MK_CTL_TOTAL] = tasks + 1;
    p.ctl[MK_CTL_PUBLISHED] = tasks;
    p.ctl[MK_CTL_TILES] = slots;
    MK_ONCE for (int s = 0; s < slots; ++s) cnt[DEC_STRIDE * s] = 0;
    if (p.decode == 2) MK_ONCE for (int i = 0; i < S * E; ++i) cnt[DEC_LOGIT0 + i] = 0;
    cnt[DEC_ABORT] = 0;  // every CTA's waits are behind its ticket: the next launch starts unaborted
    cnt[DEC_STRIDE * DEC_CNT_TICKET] = 0;
  }
}
