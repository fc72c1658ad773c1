// Routing for a few tokens in ONE kernel of one CTA per SM (MkParams.route_warp_max): the task graph's routing
// (k_logits + k_topk: a tensor-core gate GEMM split over H into partial planes, then a kernel that adds them and
// selects) is two kernels of latency at small S, ~11 µs before the first weight byte moves (run 55's trace at
// S=128: 4.8 + 6.4 µs). Here, as in the decode kernel's routing (logits at ~3.6 µs, picks at ~5.4 in run 79):
//   1. the S x E gate dot products, spread over every warp of the grid: a warp item is (expert e, a group of G
//      tokens); the warp holds one chunk of gate row e widened to fp32 and multiplies it into each of its G tokens'
//      x rows (shared memory), so the gate is read about S / G times in all, not S times;
//   2. each logit is stored where it is polled (dec_cnt words past the counters, bitwise NOT: zero = not written) and
//      into plane 0 of `logits` (the layer's routing buffer);
//   3. token t's selection runs in one warp (CTA t % grid): it polls its E logits, then warp_topk (k_topk's code:
//      the same softmax, picks, order and weights for the same logits) and appends the picks to the expert lists.
// Block 0 resets the expert kernel's counters (reset_ctl) and releases a flag the list appends wait for (they
// count on those counters). Every CTA takes an exit ticket after its last access to the dec_cnt words; the CTA with
// the last one zeroes them for the next launch. The logits are fp32 sums in another order than the split planes',
// so a near-tie may pick differently from k_logits + k_topk; the same inputs give the same bits every run.
// Included by mk_moe.cu after mk_decode.cuh (its helpers: ld_weights, dot8f, widen8, warp_sum, wait_logit, ...).

using mkidx::RW_MAXG;  // tokens per warp item (mk_index.h: rw_range splits the items over the CTAs)
constexpr int RW_RESET = 0;  // dec_cnt word (slot 0's counter line, which routing launches do not use): block 0 has
                             // reset the expert kernel's counters

template <int NI>
__global__ void __launch_bounds__(DEC_THREADS, 1) k_route_warp(const MkParams p, int G, int lg_off) {
  extern __shared__ __align__(128) char smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int S = (int)p.S, E = (int)p.E, H = (int)p.H, K = (int)p.K, HV = H / 8;
  int32_t* cnt = p.dec_cnt;
  // the persistent kernel may launch now: it waits (griddepcontrol) for this whole kernel before reading anything
  if (p.pdl) griddep_launch();
  if (blockIdx.x == 0) {
    reset_ctl(p);
    __syncthreads();
    if (tid == 0) {
      __threadfence();
      st_release(cnt + RW_RESET, 1);
    }
  }
  const mkidx::RwRange r = mkidx::rw_range(blockIdx.x, gridDim.x, S, E, G);
  bf16* xs = (bf16*)smem;  // x rows [t0, t1)
  MK_ONCE for (int v = tid; v < (r.t1 - r.t0) * HV; v += DEC_THREADS)
    ((uint4*)xs)[v] = ((const uint4*)p.x)[(int64_t)r.t0 * HV + v];
  __syncthreads();
  // 1-2. the logits of this CTA's items, a warp each
  MK_ONCE for (int it = r.i0 + warp; it < r.i1; it += DEC_WARPS) {
    const int e = it % E, tb = it / E * G, nt = min(G, S - tb);
    const uint4* g = (const uint4*)((const bf16*)p.wg + (int64_t)e * H);
    float acc[RW_MAXG];
#pragma unroll
    for (int t = 0; t < RW_MAXG; ++t) acc[t] = 0.f;
    MK_ONCE for (int v0 = 0; v0 < HV; v0 += 32 * DEC_VEC) {
      uint4 w[DEC_VEC];
#pragma unroll
      for (int i = 0; i < DEC_VEC; ++i) {  // the chunk's loads in flight together
        const int v = v0 + lane + 32 * i;
        w[i] = v < HV ? ld_weights(g + v, false, 0) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int i = 0; i < DEC_VEC; ++i) {
        const int v = v0 + lane + 32 * i;
        if (v >= HV) continue;
        float f[8];
        widen8(f, w[i]);  // once for the G tokens
        const uint4* xv = (const uint4*)(xs + (int64_t)(tb - r.t0) * H) + v;
#pragma unroll
        for (int t = 0; t < RW_MAXG; ++t) {
          if (t >= nt) break;  // warp-uniform
          dot8f(acc[t], xv[(int64_t)t * HV], f);
        }
      }
    }
#pragma unroll
    for (int t = 0; t < RW_MAXG; ++t) {
      if (t >= nt) break;  // warp-uniform
      const float a = warp_sum(acc[t]);
      if (lane == 0) {
        const int l = (tb + t) * E + e;
        p.logits[l] = a;
        st_relaxed(cnt + DEC_LOGIT0 + l, ~__float_as_int(a));
      }
    }
  }
  // 3. token t's selection in warp t / grid of CTA t % grid
  float* lg = (float*)(smem + lg_off) + warp * 32 * NI;
  MK_ONCE for (int t = blockIdx.x + (int)gridDim.x * warp; t < S; t += (int)gridDim.x * DEC_WARPS) {
    {
      const int32_t* w = cnt + DEC_LOGIT0 + t * E;
      int v[NI];
#pragma unroll
      for (int i = 0; i < NI; ++i) v[i] = lane + 32 * i < E ? ld_relaxed(w + lane + 32 * i) : 1;  // loads in flight
#pragma unroll                                                                                  // together
      for (int i = 0; i < NI; ++i) {
        const int e = lane + 32 * i;
        if (e >= E) continue;
        if (v[i] == 0) v[i] = wait_logit(p, w + e, t * E + e);  // not written yet: poll it (bounded)
        lg[e] = __int_as_float(~v[i]);
      }
    }
    __syncwarp();
    int pick_e;
    float pick_w;
    warp_topk<NI>(lg, E, K, lane, pick_e, pick_w);
    if (lane == 0) wait_count(p, cnt + RW_RESET, 1, false, -1);  // the counters are zero before the first append
    __syncwarp();
    if (lane < K) {
      const int row = t * K + lane;
      p.topk_idx[row] = pick_e;
      p.topk_w[row] = pick_w;
      const int pos = atomicAdd(p.counts + pick_e * MK_COUNT_STRIDE, 1);
      p.lists[(int64_t)pick_e * p.S_cap + pos] = row;
    }
    __syncwarp();
  }
  // the exit ticket: the last CTA is past every CTA's last dec_cnt access and zeroes the words for the next launch
  __shared__ int s_last;
  __syncthreads();
  if (tid == 0) s_last = atom_add_acq_rel(cnt + DEC_STRIDE * DEC_CNT_TICKET, 1) == (int)gridDim.x - 1;
  __syncthreads();
  if (s_last) {
    MK_ONCE for (int i = tid; i < S * E; i += DEC_THREADS) cnt[DEC_LOGIT0 + i] = 0;
    if (tid == 0) {
      cnt[RW_RESET] = 0;
      cnt[DEC_STRIDE * DEC_CNT_TICKET] = 0;
    }
  }
}
