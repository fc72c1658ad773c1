// Index arithmetic of the megakernel shared by the device code (mk_moe.cu) and a host-compiled CPU test
// (tests/test_megakernel_cpu.py builds a small C++ program with g++ against this header): shared-memory
// swizzle, wgmma shared-memory descriptors, wgmma accumulator fragment coordinates, task words and the
// split-K partial-buffer layout. Pure integer functions; no CUDA types.
#pragma once
#include <stdint.h>

#include "mk_api.h"  // MK_TASK_* (plain C)

#if defined(__CUDACC__)
#define MK_HD __host__ __device__ __forceinline__
#else
#define MK_HD inline
#endif

namespace mkidx {

// ---- shared tiles: [rows][64] bf16 (128 bytes a row, 8 chunks of 16 B), chunk index XOR (row & 7) ----
// Byte offset of element (row, k), 0 <= k < 64, inside a tile whose base is 1024-byte aligned. This is the
// layout Hopper's 128-byte swizzle (CU_TENSOR_MAP_SWIZZLE_128B; wgmma descriptor layout type 1) defines:
// address bits [4:6] XOR bits [7:9] of the unswizzled row-major address, so the same tile feeds ldmatrix
// (mma core) and wgmma (wgmma core) unchanged.
MK_HD uint32_t swz_off(uint32_t row, uint32_t k) {
  return row * 128u + ((((k >> 3) ^ (row & 7u)) & 7u) << 4) + (k & 7u) * 2u;
}
// The hardware rule, written as the PTX ISA states it, for the test to compare with swz_off.
MK_HD uint32_t swizzle128(uint32_t linear_byte) { return linear_byte ^ (((linear_byte >> 7) & 7u) << 4); }

// ---- TMA tiles (MkParams.tma_b): the B tile is two boxes of 64 rows x 64 k, box b at tile byte 8192 b ----
// Where the TMA (CU_TENSOR_MAP_SWIZZLE_128B) writes element (r, k) of a box whose shared-memory destination
// `dst` is 1024-byte aligned, as the CUDA / PTX docs define the 128-byte swizzle: the box is row-major with
// 128-byte rows, and 16-byte chunk c of row r of each 1024-byte (8-row) atom goes to chunk c ^ (r % 8).
// Written from that rule, not from swz_off, so the CPU test can compare the two.
MK_HD uint32_t tma_box_dst(uint32_t dst, uint32_t r, uint32_t k) {
  return dst + (r / 8u) * 1024u + (r % 8u) * 128u + (((k / 8u) ^ (r % 8u)) * 16u) + (k % 8u) * 2u;
}
// Weight row (inside expert e's [2I, H] block) of GEMM1 tile row n of n-block nb: box 0 = gate rows
// nb*64.., box 1 = up rows I + nb*64.. (the cp.async tiles interleave them instead: fill_meta).
MK_HD int64_t tma_gemm1_row(int nb, int n, int64_t I) { return n < 64 ? (int64_t)nb * 64 + n : I + nb * 64 + (n - 64); }
// ---- the wide tile (MkParams.bn = 256: wgmma core, bm = 128, 128 x 256 per task) ---------------------
// A wide task covers the two 128-column n-blocks nb (even) and nb + 1. Its B tile is 256 rows, stacked the
// same way for cp.async and TMA: GEMM1 rows 0..127 = gate rows nb*64 .. nb*64+127, rows 128..255 = the up rows
// of the same 128 intermediate columns, so in the m64n256 fragment register i (< 64) holds gate column c and
// register i + 64 its up column c + 128 of the same row (one thread: SwiGLU in registers); GEMM2 rows 0..255
// = W_down rows nb*128 .. nb*128+255 (y columns nb*128 + c). Weight row inside expert e's block:
MK_HD int64_t wide_gemm1_row(int nb, int n, int64_t I) {
  return n < 128 ? (int64_t)nb * 64 + n : I + (int64_t)nb * 64 + (n - 128);
}
MK_HD int64_t wide_gemm2_row(int nb, int n) { return (int64_t)nb * 128 + n; }
// TMA: box b (0..3) of 64 rows lands at tile byte 8192 b and starts at the weight row of its first tile row
// (boxes never straddle the gate / up halves: 128 is a multiple of the box's 64 rows).
MK_HD int64_t wide_box_row(int gemm2, int nb, int b, int64_t I) {
  return gemm2 ? wide_gemm2_row(nb, 64 * b) : wide_gemm1_row(nb, 64 * b, I);
}
// mma core, TMA tile (bm = 16: 4 warps by column): first tile column of n8 block j (0..3) of warp wn; blocks
// j and j + 2 hold the same 16 columns of each half, so a warp owns (gate, up) pairs for SwiGLU.
MK_HD int tma_bcol(int wn, int j) { return (j >> 1) * 64 + wn * 16 + (j & 1) * 8; }

// ---- wgmma shared-memory matrix descriptor (PTX ISA "Matrix Descriptor Format", sm_90) ---------------
// bits 0-13 start address >> 4, 16-29 leading byte offset >> 4, 32-45 stride byte offset >> 4,
// 49-51 base offset (0: tiles 1024-byte aligned), 62-63 layout (1 = 128-byte swizzle).
// K-major operand in the layout above: 8-row core-matrix groups 1024 bytes apart (SBO = 1024); the
// leading offset is unused for a swizzled K-major operand whose k16 slice stays inside one 128-byte row
// (set to 1 as CUTLASS does). A k16 step inside the 64-wide tile advances the start address by 32 bytes:
// the hardware applies the swizzle to the computed address, so the XOR pattern stays the one the
// producers wrote (the tile base must be 1024-byte aligned for that).
constexpr uint64_t DESC_SWIZZLE_128B = 1;
MK_HD uint64_t wg_desc(uint32_t smem_addr, uint32_t sbo_bytes = 1024, uint32_t lbo_bytes = 16) {
  uint64_t d = 0;
  d |= (uint64_t)((smem_addr & 0x3FFFFu) >> 4);
  d |= (uint64_t)((lbo_bytes & 0x3FFFFu) >> 4) << 16;
  d |= (uint64_t)((sbo_bytes & 0x3FFFFu) >> 4) << 32;
  d |= DESC_SWIZZLE_128B << 62;
  return d;
}
MK_HD uint32_t desc_start(uint64_t d) { return (uint32_t)(d & 0x3FFFu) << 4; }
MK_HD uint32_t desc_lbo(uint64_t d) { return (uint32_t)((d >> 16) & 0x3FFFu) << 4; }
MK_HD uint32_t desc_sbo(uint64_t d) { return (uint32_t)((d >> 32) & 0x3FFFu) << 4; }
MK_HD uint32_t desc_layout(uint64_t d) { return (uint32_t)(d >> 62); }
// Shared address (byte) of element (row, k) that a wgmma reading descriptor `d` (K-major, 128-byte
// swizzle) sees for row `row` and k element `k` of its k16 slice: the model the CPU test checks against
// swz_off (start + row group * SBO + row-in-group * 128 + k * 2, then the swizzle of the address bits).
MK_HD uint32_t desc_elem_addr(uint64_t d, uint32_t row, uint32_t k) {
  const uint32_t lin = desc_start(d) + (row >> 3) * desc_sbo(d) + (row & 7u) * 128u + k * 2u;
  return swizzle128(lin);
}

// ---- wgmma m64nNk16 f32 accumulator fragment: register i of thread t (0..127) of the warpgroup -------
// row = 16 * warp + (lane >> 2) + 8 * ((i >> 1) & 1), col = 8 * (i >> 2) + 2 * (lane & 3) + (i & 1)
MK_HD uint32_t acc_row(uint32_t t, uint32_t i) { return 16u * (t >> 5) + ((t & 31u) >> 2) + 8u * ((i >> 1) & 1u); }
MK_HD uint32_t acc_col(uint32_t t, uint32_t i) { return 8u * (i >> 2) + 2u * (t & 3u) + (i & 1u); }

// ---- task words: kind 61-63, splits-1 57-60, expert 48-56, m-tile 32-47, n-field 20-31, tile 0-19 -----
// n-field = nb + N * ks (N = n-blocks of the GEMM; ks the split-K part, 0 without split-K).
MK_HD uint64_t enc(int kind, int e, int mt, int nfield, int tile, int splits = 1) {
  return ((uint64_t)kind << 61) | ((uint64_t)(splits - 1) << 57) | ((uint64_t)e << 48) | ((uint64_t)mt << 32) |
         ((uint64_t)nfield << 20) | (uint64_t)tile;
}
MK_HD int t_kind(uint64_t w) { return (int)(w >> 61); }
MK_HD int t_splits(uint64_t w) { return (int)((w >> 57) & 0xf) + 1; }
MK_HD int t_expert(uint64_t w) { return (int)((w >> 48) & 0x1ff); }
MK_HD int t_mtile(uint64_t w) { return (int)((w >> 32) & 0xffff); }
MK_HD int t_nfield(uint64_t w) { return (int)((w >> 20) & 0xfff); }
MK_HD int t_tile(uint64_t w) { return (int)(w & 0xfffff); }
// One expert's m-tiles, at most: they number 0 .. MAX_EXPERT_TILES - 1 in the 16-bit m-tile field; another would
// spill into the expert's bits.
// runtime/megakernel/config.py mirrors it (MAX_EXPERT_TILES, limits_problem).
constexpr int64_t MAX_EXPERT_TILES = 1 << 16;

// ---- m-tiles ------------------------------------------------------------------------------------------
// An expert with cnt routed rows owns ceil(cnt / bm) m-tiles, except that with `tail` > 0 (MkParams.tail_rows: the
// wide tile on the overlap kernel) its last r = cnt % bm rows, 1 <= r <= tail, ride in its last full m-tile (bm + r
// rows) instead of an m-tile of their own, whose tasks would stream the expert's whole weight tile again for them.
MK_HD int expert_tiles(int cnt, int bm, int tail) {
  const int n = (cnt + bm - 1) / bm, r = cnt % bm;
  return tail > 0 && n > 1 && r > 0 && r <= tail ? n - 1 : n;
}
// The most m-tiles one expert can own in a launch of S_cap token rows and m-tile bm: its row list holds S_cap rows
// (MkParams.lists [E, S_cap]; the routing kernels pick K distinct experts per token, so at most S of them), an m-tile
// bm of them (a tail rides in the last m-tile: fewer, never more). check_params bounds it by MAX_EXPERT_TILES.
MK_HD int64_t expert_tiles_max(int64_t s_cap, int64_t bm) { return (s_cap + bm - 1) / bm; }
// One past the last of m-tile mt's rows in the expert's list (its first is mt * bm).
MK_HD int tile_end(int cnt, int mt, int bm, int tail) {
  return mt + 1 >= expert_tiles(cnt, bm, tail) ? cnt : (mt + 1) * bm;
}

// ---- the queue ------------------------------------------------------------------------------------------
// Expert owning m-tile `tile` (base[] = exclusive prefix of m-tiles per expert, base[E] = total).
MK_HD int tile_expert(const int* base, int E, int tile) {
  int lo = 0, hi = E - 1;
  while (lo < hi) {  // largest e with base[e] <= tile
    const int mid = (lo + hi + 1) >> 1;
    if (base[mid] <= tile) lo = mid; else hi = mid - 1;
  }
  return lo;
}
// The word of queue slot i when every task is published at once (publish_all): g1 = n_tiles * G1 GEMM1 tasks
// tile-major (n-field = nb + N1 * ks, W n-blocks per task), then each m-tile's G2 GEMM2 tasks, then NC combine
// tasks per combine tile. The scheduler writes these words; a processor can compute the one it claimed.
MK_HD uint64_t queue_word(int i, const int* base, int E, int G1, int KS1, int G2, int KS2, int NC, int W) {
  const int n_tiles = base[E], g1 = n_tiles * G1;
  if (i < g1) {
    const int tile = i / G1, nf = i % G1;
    const int e = tile_expert(base, E, tile);
    return enc(MK_TASK_GEMM1, e, tile - base[e], nf * W, tile, KS1);
  }
  if (i < g1 + n_tiles * G2) {
    const int tile = (i - g1) / G2, nf = (i - g1) % G2;
    const int e = tile_expert(base, E, tile);
    return enc(MK_TASK_GEMM2, e, tile - base[e], nf * W, tile, KS2);
  }
  const int c = i - g1 - n_tiles * G2;
  return enc(MK_TASK_COMBINE, 0, c / NC, c % NC, 0);
}

// ---- staged epilogue (the overlap kernel's wg_store_staged): a consumer warp's 16 rows x 64 columns of bf16 ------
// Row r of the 2 KB buffer at r * 128, its 16-byte unit u (columns 8u .. 8u+7 of the chunk) at (u ^ (r & 7)) * 16:
// the 8 rows of an 8x8 matrix, and the 8 units of a row, each land in distinct bank groups.
MK_HD uint32_t stage_out_off(uint32_t row, uint32_t unit) { return row * 128u + ((unit ^ (row & 7u)) << 4); }
// stmatrix .x4 number m (0..3) of chunk ch: lane l gives the address of row l & 7 of matrix l >> 3, which is warp
// row stsm_row(l) and unit stsm_unit(m, l); register q of every thread holds matrix q, the accumulator pair of half
// q & 1 (acc_row's + 8) in 8-column group stsm_group(ch, m, q) of the output row.
MK_HD uint32_t stsm_row(uint32_t lane) { return 8u * ((lane >> 3) & 1u) + (lane & 7u); }
MK_HD uint32_t stsm_unit(uint32_t m, uint32_t lane) { return 2u * m + (lane >> 4); }
MK_HD uint32_t stsm_group(uint32_t ch, uint32_t m, uint32_t q) { return 8u * ch + 2u * m + (q >> 1); }

// ---- split-K (decode): partial sums of (GEMM, m-tile, n-block) "slots" -------------------------------
// Slot of a GEMM1 task: tile * N1 + nb; of a GEMM2 task: max_tiles * N1 + tile * N2 + nb.
MK_HD int sk_slot(int gemm2, int tile, int nb, int n1, int n2, int max_tiles) {
  return gemm2 ? max_tiles * n1 + tile * n2 + nb : tile * n1 + nb;
}
// Float index of accumulator register i of thread t in split part ks of a slot (parts of one slot
// adjacent; registers of a part strided by the thread count so a warp's stores coalesce). Every slot has
// room for `max_splits` parts (the kernel passes max(split_k1, split_k2)).
MK_HD int64_t sk_index(int slot, int ks, int i, int t, int threads, int nacc, int max_splits) {
  return (((int64_t)slot * max_splits + ks) * nacc + i) * threads + t;
}

}  // namespace mkidx
