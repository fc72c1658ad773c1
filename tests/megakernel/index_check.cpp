// Host-compiled check of csrc/megakernel/mk_index.h (built and run by tests/test_megakernel_cpu.py with g++).
// Prints "ok <n checks>" or the first failure and exits non-zero.
#include <stdio.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <set>
#include <vector>

#include "mk_index.h"

using namespace mkidx;
static long n_checks = 0;
#define CHECK(c, ...)                       \
  do {                                      \
    ++n_checks;                             \
    if (!(c)) {                             \
      printf("FAIL %s: ", #c);              \
      printf(__VA_ARGS__);                  \
      printf("\n");                         \
      exit(1);                              \
    }                                       \
  } while (0)

int main() {
  // 1. the tile layout is Hopper's 128-byte swizzle of the row-major [rows][64] bf16 tile, and the mma
  //    core's inline formula (load_stage / ldmatrix addressing in mk_moe.cu) is the same map
  for (uint32_t r = 0; r < 256; ++r)
    for (uint32_t k = 0; k < 64; ++k) {
      CHECK(swz_off(r, k) == swizzle128(r * 128 + k * 2), "r=%u k=%u", r, k);
      if (k % 8 == 0) CHECK(swz_off(r, k) == (r * 8 + ((k / 8) ^ (r & 7))) * 16, "mma formula r=%u k=%u", r, k);
    }
  // a tile's bytes are a permutation (no two elements share a byte pair)
  {
    std::set<uint32_t> seen;
    for (uint32_t r = 0; r < 128; ++r)
      for (uint32_t k = 0; k < 64; ++k) seen.insert(swz_off(r, k));
    CHECK(seen.size() == 128 * 64 && *seen.rbegin() == 128 * 128 - 2, "size %zu", seen.size());
  }
  // 2. descriptor fields
  const uint64_t d0 = wg_desc(0x12400);
  CHECK(desc_start(d0) == 0x12400 && desc_sbo(d0) == 1024 && desc_lbo(d0) == 16 && desc_layout(d0) == 1, "fields");
  CHECK((d0 >> 62) == 1 && ((d0 >> 49) & 7) == 0, "layout / base offset bits");
  CHECK((uint32_t)(d0 >> 32) == 0x40000040u, "high word %08x (the SASS shows MOV R, 0x40000040)", (uint32_t)(d0 >> 32));
  // 3. what a wgmma reads through the descriptor of k16 slice kk of consumer c's 64 rows (A) or the 128 rows
  //    (B) of stage s, is exactly the element the producer stored there (base = 1024-aligned stage tile)
  const uint32_t stage_bytes[2] = {64 * 128 + 128 * 128, 128 * 128 + 128 * 128};  // bm = 64, 128
  for (int t = 0; t < 2; ++t)
    for (uint32_t s = 0; s < 6; ++s) {
      const uint32_t smem0 = 0x400 * 3;  // the aligned dynamic-smem start (any multiple of 1024)
      const uint32_t sA = smem0 + s * stage_bytes[t], a_bytes = (t ? 128 : 64) * 128, sB = sA + a_bytes;
      CHECK(sA % 1024 == 0 && sB % 1024 == 0, "alignment");
      for (uint32_t kk = 0; kk < 4; ++kk) {
        for (uint32_t c = 0; c < (t ? 2u : 1u); ++c) {
          const uint64_t da = wg_desc(sA + c * 64 * 128 + kk * 32);
          for (uint32_t r = 0; r < 64; ++r)
            for (uint32_t k = 0; k < 16; ++k)
              CHECK(desc_elem_addr(da, r, k) == sA + swz_off(64 * c + r, kk * 16 + k), "A t=%d s=%u kk=%u c=%u r=%u k=%u",
                    t, s, kk, c, r, k);
        }
        const uint64_t db = wg_desc(sB + kk * 32);
        for (uint32_t n = 0; n < 128; ++n)
          for (uint32_t k = 0; k < 16; ++k)
            CHECK(desc_elem_addr(db, n, k) == sB + swz_off(n, kk * 16 + k), "B s=%u kk=%u n=%u k=%u", s, kk, n, k);
      }
    }
  // 4. accumulator fragment: 128 threads x 64 registers cover the 64 x 128 tile once; pairs (i, i+1), i even,
  //    are adjacent columns of one row (the epilogue's (gate, up) / bf16x2 pairs), first column even
  {
    std::vector<int> hit(64 * 128, 0);
    for (uint32_t t = 0; t < 128; ++t)
      for (uint32_t i = 0; i < 64; ++i) {
        const uint32_t r = acc_row(t, i), c = acc_col(t, i);
        CHECK(r < 64 && c < 128, "range t=%u i=%u", t, i);
        hit[r * 128 + c]++;
        if (i % 2 == 0) CHECK(acc_row(t, i + 1) == r && acc_col(t, i + 1) == c + 1 && c % 2 == 0, "pair t=%u i=%u", t, i);
        // PTX ISA wgmma D fragment (m64nNk16, f32): row = warp*16 + lane/4 (+8 for registers 2,3 of each 4)
        CHECK(r == (t / 32) * 16 + (t % 32) / 4 + ((i % 4) >= 2 ? 8 : 0) && c == (i / 4) * 8 + (t % 4) * 2 + (i % 2),
              "ptx layout t=%u i=%u", t, i);
      }
    for (int x = 0; x < 64 * 128; ++x) CHECK(hit[x] == 1, "element %d hit %d times", x, hit[x]);
  }
  // 5. task words round-trip at the field limits
  const int kinds[3] = {1, 2, 3};
  for (int kind : kinds)
    for (int splits : {1, 2, 4, 16})
      for (int e : {0, 1, 127, 511})
        for (int mt : {0, 7, 65535})
          for (int nf : {0, 11, 47, 4095})
            for (int tile : {0, 3, (1 << 20) - 1}) {
              const uint64_t w = enc(kind, e, mt, nf, tile, splits);
              CHECK(t_kind(w) == kind && t_splits(w) == splits && t_expert(w) == e && t_mtile(w) == mt &&
                        t_nfield(w) == nf && t_tile(w) == tile,
                    "kind=%d splits=%d e=%d mt=%d nf=%d tile=%d", kind, splits, e, mt, nf, tile);
            }
  // 6. split-K partial buffer: every (slot, part, register, thread) has its own float, inside the buffer
  {
    const int n1 = 12, n2 = 16, max_tiles = 16, threads = 128, nacc = 16;
    for (int stride : {2, 4}) {
      const int64_t size = (int64_t)max_tiles * (n1 + n2) * stride * nacc * threads;
      std::vector<char> used(size, 0);
      for (int g2 = 0; g2 < 2; ++g2)
        for (int tile = 0; tile < max_tiles; ++tile)
          for (int nb = 0; nb < (g2 ? n2 : n1); ++nb) {
            const int slot = sk_slot(g2, tile, nb, n1, n2, max_tiles);
            CHECK(slot >= 0 && slot < max_tiles * (n1 + n2), "slot %d", slot);
            for (int ks = 0; ks < stride; ++ks)
              for (int i = 0; i < nacc; ++i)
                for (int t = 0; t < threads; t += 31) {
                  const int64_t x = sk_index(slot, ks, i, t, threads, nacc, stride);
                  CHECK(x >= 0 && x < size && !used[x], "index %lld", (long long)x);
                  used[x] = 1;
                }
          }
      // a warp's 32 threads store 32 consecutive floats (coalesced)
      CHECK(sk_index(3, 1, 5, 17, threads, nacc, stride) + 1 == sk_index(3, 1, 5, 18, threads, nacc, stride), "stride");
    }
  }
  // 7. TMA tiles (MkParams.tma_b): the two 64-row boxes of a B tile land exactly where swz_off (cp.async, the
  //    ldmatrix reads) and the wgmma descriptors (section 3) expect tile rows 0..63 and 64..127
  {
    // stage tiles: bm = 16 mma (A 2 KB + B 16 KB), wgmma bm = 64 / 128; the B tile's base is 1024-aligned
    const uint32_t a_bytes[3] = {16 * 128, 64 * 128, 128 * 128};
    for (int t = 0; t < 3; ++t)
      for (uint32_t s = 0; s < 12; ++s) {
        const uint32_t sB = 0x400 * 5 + s * (a_bytes[t] + 128 * 128) + a_bytes[t];
        CHECK(sB % 1024 == 0, "B tile alignment t=%d s=%u", t, s);
        for (uint32_t b = 0; b < 2; ++b)
          for (uint32_t r = 0; r < 64; ++r)
            for (uint32_t k = 0; k < 64; ++k)
              CHECK(tma_box_dst(sB + 8192 * b, r, k) == sB + swz_off(64 * b + r, k), "box t=%d s=%u b=%u r=%u k=%u", t,
                    s, b, r, k);
      }
    // the hardware rule as an address-bit XOR on the whole (1024-aligned) shared address, too
    for (uint32_t r = 0; r < 64; ++r)
      for (uint32_t k = 0; k < 64; k += 8)
        CHECK(tma_box_dst(0x2400, r, k) == swizzle128(0x2400 + r * 128 + k * 2), "xor form r=%u k=%u", r, k);
    const int64_t I = 768;
    for (int nb = 0; nb < 12; ++nb) {
      // the cp.async tile interleaves (gate, up) rows (fill_meta); the TMA tile stacks them: the same rows
      std::set<int64_t> inter, stacked;
      for (int n = 0; n < 128; ++n) {
        inter.insert((n & 1) ? I + nb * 64 + n / 2 : (int64_t)nb * 64 + n / 2);
        stacked.insert(tma_gemm1_row(nb, n, I));
      }
      CHECK(inter == stacked, "GEMM1 rows nb=%d", nb);
      // mma core (bm = 16, warps by column): block j and j + 2 of a warp are gate / up of the same h columns,
      // the ldmatrix x4 of block pair (2j, 2j+1) reads those rows, and 4 warps cover 64 h columns once
      std::vector<int> h(64, 0), g2(128, 0);
      for (int wn = 0; wn < 4; ++wn)
        for (int lane = 0; lane < 32; ++lane) {
          for (int j = 0; j < 2; ++j) {
            const int m = lane >> 3;  // ldmatrix matrix this lane addresses: (n8 block 2j + m/2, k half m % 2)
            const int row = tma_bcol(wn, 2 * j) + (lane & 7) + ((lane >> 4) << 3);
            CHECK(row == tma_bcol(wn, 2 * j + (m >> 1)) + (lane & 7) && ((lane >> 3) & 1) == (m & 1), "ldsm lane %d", lane);
            for (int e = 0; e < 2; ++e) {
              const int c = tma_bcol(wn, j) + 2 * (lane & 3) + e, u = tma_bcol(wn, j + 2) + 2 * (lane & 3) + e;
              CHECK(c < 64 && u == c + 64, "pair wn=%d lane=%d j=%d", wn, lane, j);
              CHECK(tma_gemm1_row(nb, c, I) == nb * 64 + c && tma_gemm1_row(nb, u, I) == I + nb * 64 + c, "rows");
              if ((lane >> 2) == 0) h[c]++;
            }
          }
          for (int j = 0; j < 4; ++j)
            for (int e = 0; e < 2; ++e)
              if ((lane >> 2) == 0) g2[tma_bcol(wn, j) + 2 * (lane & 3) + e]++;
        }
      for (int c = 0; c < 64; ++c) CHECK(h[c] == 1, "h column %d hit %d", c, h[c]);
      for (int c = 0; c < 128; ++c) CHECK(g2[c] == 1, "GEMM2 column %d hit %d", c, g2[c]);
    }
    // wgmma core: register i < 32 holds gate column c < 64, register i + 32 its up column c + 64 (same row)
    for (uint32_t t = 0; t < 128; ++t)
      for (uint32_t i = 0; i < 32; ++i)
        CHECK(acc_col(t, i) < 64 && acc_col(t, i + 32) == acc_col(t, i) + 64 && acc_row(t, i + 32) == acc_row(t, i),
              "wgmma pair t=%u i=%u", t, i);
  }
  // 8. the wide tile (bn = 256, wgmma core, bm = 128): stage = A 128 rows (16 KB) + B 256 rows (32 KB), <= 4 stages
  {
    const int64_t I = 768, H = 2048;
    const uint32_t a_bytes = 128 * 128, b_bytes = 256 * 128, stage = a_bytes + b_bytes;
    for (uint32_t s = 0; s < 4; ++s) {
      const uint32_t sA = 0x400 * 7 + s * stage, sB = sA + a_bytes;
      CHECK(sA % 1024 == 0 && sB % 1024 == 0 && sB + b_bytes <= 227 * 1024, "wide alignment s=%u", s);
      for (uint32_t kk = 0; kk < 4; ++kk) {
        // each consumer's A descriptor (64 rows) and the shared B descriptor (256 rows) read what was stored
        for (uint32_t c = 0; c < 2; ++c) {
          const uint64_t da = wg_desc(sA + c * 64 * 128 + kk * 32);
          for (uint32_t r = 0; r < 64; ++r)
            for (uint32_t k = 0; k < 16; ++k)
              CHECK(desc_elem_addr(da, r, k) == sA + swz_off(64 * c + r, kk * 16 + k), "wide A s=%u kk=%u c=%u r=%u", s,
                    kk, c, r);
        }
        const uint64_t db = wg_desc(sB + kk * 32);
        CHECK(desc_start(db) == sB + kk * 32 && desc_sbo(db) == 1024, "wide B desc");
        for (uint32_t n = 0; n < 256; ++n)
          for (uint32_t k = 0; k < 16; ++k)
            CHECK(desc_elem_addr(db, n, k) == sB + swz_off(n, kk * 16 + k), "wide B s=%u kk=%u n=%u k=%u", s, kk, n, k);
      }
      // the four TMA boxes land as tile rows 64 b .. 64 b + 63, where the descriptors read them
      for (uint32_t b = 0; b < 4; ++b)
        for (uint32_t r = 0; r < 64; ++r)
          for (uint32_t k = 0; k < 64; ++k)
            CHECK(tma_box_dst(sB + 8192 * b, r, k) == sB + swz_off(64 * b + r, k), "wide box s=%u b=%u r=%u k=%u", s, b,
                  r, k);
    }
    // weight rows: box b starts at tile row 64 b's weight row and its 64 rows are consecutive (what cp.async's
    // b_off rows hold, fill_meta); a wide task's rows are exactly those of the two 128-column n-blocks it covers
    for (int nb = 0; nb < 12; nb += 2) {
      std::set<int64_t> wide1, narrow1;
      for (int n = 0; n < 256; ++n) {
        const int b = n / 64, r = n % 64;
        CHECK(wide_box_row(0, nb, b, I) + r == wide_gemm1_row(nb, n, I), "GEMM1 box rows nb=%d n=%d", nb, n);
        CHECK(wide_box_row(1, nb, b, I) + r == wide_gemm2_row(nb, n), "GEMM2 box rows nb=%d n=%d", nb, n);
        wide1.insert(wide_gemm1_row(nb, n, I));
      }
      for (int q = 0; q < 2; ++q)
        for (int n = 0; n < 128; ++n) narrow1.insert((n & 1) ? I + (nb + q) * 64 + n / 2 : (int64_t)(nb + q) * 64 + n / 2);
      CHECK(wide1 == narrow1 && wide1.size() == 256, "wide GEMM1 rows nb=%d", nb);
      CHECK(wide_gemm1_row(nb, 255, I) < 2 * I && wide_gemm2_row(nb + 4, 255) < H, "row range nb=%d", nb);
    }
    // the m64n256 fragment: 128 threads x 128 registers cover 64 x 256 once (PTX layout); the epilogue's pairs
    std::vector<int> hit(64 * 256, 0), h(64 * 128, 0), y(64 * 256, 0);
    for (uint32_t t = 0; t < 128; ++t)
      for (uint32_t i = 0; i < 128; ++i) {
        const uint32_t r = acc_row(t, i), c = acc_col(t, i);
        CHECK(r < 64 && c < 256, "wide range t=%u i=%u", t, i);
        CHECK(r == (t / 32) * 16 + (t % 32) / 4 + ((i % 4) >= 2 ? 8 : 0) && c == (i / 4) * 8 + (t % 4) * 2 + (i % 2),
              "wide ptx layout t=%u i=%u", t, i);
        hit[r * 256 + c]++;
      }
    for (int x = 0; x < 64 * 256; ++x) CHECK(hit[x] == 1, "wide element %d hit %d times", x, hit[x]);
    const int nb = 6;  // any even n-block
    for (uint32_t t = 0; t < 128; ++t)
      for (int half = 0; half < 2; ++half) {
        // GEMM1 (run_gemm_wg: j < NACC/8, i = 4j + 2 half, up register i + NACC/2): (gate, up) of one h column
        for (int j = 0; j < 16; ++j) {
          const uint32_t i = 4 * j + 2 * half, r = acc_row(t, i);
          for (uint32_t e = 0; e < 2; ++e) {
            const uint32_t gc = acc_col(t, i + e), uc = acc_col(t, i + 64 + e);
            CHECK(acc_row(t, i + e) == r && acc_row(t, i + 64 + e) == r && gc < 128 && uc == gc + 128,
                  "wide pair t=%u i=%u", t, i);
            CHECK(gc == acc_col(t, i) + e, "store_h2 columns q, q+1 t=%u i=%u", t, i);
            // gate row nb*64 + q and up row I + nb*64 + q: h column nb*64 + q (store_h2's column)
            CHECK(wide_gemm1_row(nb, gc, I) == nb * 64 + gc && wide_gemm1_row(nb, uc, I) == I + nb * 64 + gc,
                  "wide (gate, up) rows t=%u i=%u", t, i);
            h[r * 128 + gc]++;
          }
        }
        // GEMM2 (j < NACC/4): y columns nb*128 + c, c + 1 from W_down rows nb*128 + c (n-blocks nb, nb + 1)
        for (int j = 0; j < 32; ++j) {
          const uint32_t i = 4 * j + 2 * half, r = acc_row(t, i), c = acc_col(t, i);
          CHECK(acc_col(t, i + 1) == c + 1 && acc_row(t, i + 1) == r && c % 2 == 0, "y pair t=%u i=%u", t, i);
          CHECK(wide_gemm2_row(nb, c) == (int64_t)nb * 128 + c, "W_down row");
          y[r * 256 + c]++;
          y[r * 256 + c + 1]++;
        }
      }
    for (int x = 0; x < 64 * 128; ++x) CHECK(h[x] == 1, "wide h element (%d, %d) hit %d", x / 128, x % 128, h[x]);
    for (int x = 0; x < 64 * 256; ++x) CHECK(y[x] == 1, "wide y element (%d, %d) hit %d", x / 256, x % 256, y[x]);
  }
  // 9. one wide task end to end on the index math: the producer's stores (TMA boxes for B, swz_off for A) into a
  //    byte image of the stage, the wgmma reads through the descriptors, the fragment, the epilogue's columns;
  //    GEMM1 (SwiGLU -> h) and GEMM2 (-> y) compared with the plain products (small exact integers: no rounding)
  {
    const int I = 256, H = 128, E = 2, ROWS = 128;  // 2I = 512 (N1 = 4), H = 128 (K of GEMM1)
    std::vector<float> w1((size_t)E * 2 * I * H), x((size_t)ROWS * H), hh((size_t)ROWS * I);
    uint32_t seed = 1;
    auto rnd = [&]() { seed = seed * 1103515245u + 12345u; return (float)((int)((seed >> 16) % 7) - 3); };
    for (auto& v : w1) v = rnd();
    for (auto& v : x) v = rnd();
    for (auto& v : hh) v = rnd();
    const int e = 1;
    std::vector<float> smem(96 * 1024 / 2);  // one stage image (A 16 KB + B 32 KB), indexed by byte / 2
    // One wide task's k loop, stage by stage: the producer stores A (128 rows of `a`, row length K, by swz_off) and
    // B (four TMA boxes, box bx from weight row b_row0 + wide_box_row(gemm2, nb, bx, I) of `b`) into the stage
    // image, then the two consumer warpgroups run 4 k16 wgmmas each through the descriptors into D [128 x 256].
    auto run_task = [&](const std::vector<float>& a, const std::vector<float>& b, int K, int gemm2, int nb,
                        int64_t b_row0, std::vector<double>& D) {
      const uint32_t sA = 0, sB = 128 * 128;
      for (int kt = 0; kt < K / 64; ++kt) {
        for (int r = 0; r < 128; ++r)
          for (int k = 0; k < 64; ++k) smem[(sA + swz_off(r, k)) / 2] = a[(size_t)r * K + kt * 64 + k];
        for (int bx = 0; bx < 4; ++bx) {
          const int64_t row0 = b_row0 + wide_box_row(gemm2, nb, bx, I);
          for (uint32_t r = 0; r < 64; ++r)
            for (uint32_t k = 0; k < 64; ++k)
              smem[tma_box_dst(sB + 8192 * bx, r, k) / 2] = b[(size_t)(row0 + r) * K + kt * 64 + k];
        }
        for (int c = 0; c < 2; ++c)
          for (uint32_t kk = 0; kk < 4; ++kk) {
            const uint64_t da = wg_desc(sA + c * 64 * 128 + kk * 32), db = wg_desc(sB + kk * 32);
            for (uint32_t r = 0; r < 64; ++r)
              for (uint32_t n = 0; n < 256; ++n) {
                double acc = 0;
                for (uint32_t k = 0; k < 16; ++k) acc += (double)smem[desc_elem_addr(da, r, k) / 2] * smem[desc_elem_addr(db, n, k) / 2];
                D[(64 * c + r) * 256 + n] += acc;
              }
          }
      }
    };
    for (int nb = 0; nb < 4; nb += 2) {  // GEMM1: wide tasks at n-blocks 0 and 2 of N1 = 4
        std::vector<double> D(128 * 256, 0.0);
        run_task(x, w1, H, 0, nb, (int64_t)e * 2 * I, D);  // K = H, weight rows from e * 2I
        // epilogue as run_gemm_wg writes it: h column nb*64 + acc_col(t, i) from registers i, i+1 (gate), i+64, i+65 (up)
        std::vector<int> wrote(ROWS * I, 0);
        for (int c = 0; c < 2; ++c)
          for (uint32_t t = 0; t < 128; ++t)
            for (int half = 0; half < 2; ++half)
              for (int j = 0; j < 16; ++j) {
                const uint32_t i = 4 * j + 2 * half, r = 64 * c + acc_row(t, i), q = acc_col(t, i);
                for (uint32_t z = 0; z < 2; ++z) {
                  const double g = D[r * 256 + acc_col(t, i + z)], u = D[r * 256 + acc_col(t, i + 64 + z)];
                  const int col = nb * 64 + q + z;
                  double rg = 0, ru = 0;  // reference: gate row col, up row I + col of expert e
                  for (int k = 0; k < H; ++k) {
                    rg += (double)x[(size_t)r * H + k] * w1[((size_t)e * 2 * I + col) * H + k];
                    ru += (double)x[(size_t)r * H + k] * w1[((size_t)e * 2 * I + I + col) * H + k];
                  }
                  CHECK(g == rg && u == ru, "GEMM1 e2e nb=%d r=%u col=%d: %g/%g vs %g/%g", nb, r, col, g, u, rg, ru);
                  wrote[r * I + col]++;
                }
              }
        for (int r = 0; r < ROWS; ++r)
          for (int col = 0; col < I; ++col)
            CHECK(wrote[r * I + col] == (col / 128 == nb / 2 ? 1 : 0), "GEMM1 e2e coverage nb=%d r=%d col=%d", nb, r, col);
      }
    // GEMM2 (K = I = 256, W_down [E, H2, I] with H2 = 512: n-blocks 0..3, wide tasks at nb = 0, 2)
    const int H2 = 512;
    std::vector<float> wd((size_t)E * H2 * I);
    for (auto& v : wd) v = rnd();
    for (int nb = 0; nb < 4; nb += 2) {
      std::vector<double> D(128 * 256, 0.0);
      run_task(hh, wd, I, 1, nb, (int64_t)e * H2, D);  // K = I, weight rows from e * H2
      std::vector<int> wrote(ROWS * H2, 0);
      for (int c = 0; c < 2; ++c)
        for (uint32_t t = 0; t < 128; ++t)
          for (int half = 0; half < 2; ++half)
            for (int j = 0; j < 32; ++j) {  // store_pair: y columns nb*128 + acc_col(t, i), +1
              const uint32_t i = 4 * j + 2 * half, r = 64 * c + acc_row(t, i);
              for (uint32_t z = 0; z < 2; ++z) {
                const int col = nb * 128 + (int)acc_col(t, i) + (int)z;
                double ref = 0;
                for (int k = 0; k < I; ++k) ref += (double)hh[(size_t)r * I + k] * wd[((size_t)e * H2 + col) * I + k];
                CHECK(D[r * 256 + acc_col(t, i + z)] == ref, "GEMM2 e2e nb=%d r=%u col=%d", nb, r, col);
                wrote[r * H2 + col]++;
              }
            }
      for (int r = 0; r < ROWS; ++r)
        for (int col = 0; col < H2; ++col)
          CHECK(wrote[r * H2 + col] == (col / 256 == nb / 2 ? 1 : 0), "GEMM2 e2e coverage nb=%d r=%d col=%d", nb, r, col);
    }
  }
  // 10. queue_word (publish_all: the scheduler writes these words and claim_local computes them): slot order
  //     GEMM1s tile-major (n-field nb + N1 * ks), then every m-tile's GEMM2s, then the combines, each word naming
  //     the expert that owns its m-tile; checked against a plain walk over experts and m-tiles
  for (int trial = 0; trial < 40; ++trial) {
    const int E = 1 + trial % 17, N1 = 12, N2 = 16, W = trial % 3 == 0 ? 2 : 1, KS1 = W == 2 ? 1 : 1 + trial % 3;
    const int KS2 = W == 2 ? 1 : 1 + (trial / 3) % 2, NC = trial % 2 ? 4 : 1, n_ct = 1 + trial % 5;
    std::vector<int> base(E + 1, 0);
    uint32_t seed = 77 + trial;
    for (int e = 0; e < E; ++e) {
      seed = seed * 1103515245u + 12345u;
      base[e + 1] = base[e] + (int)((seed >> 16) % 4);  // 0..3 m-tiles per expert, some empty
    }
    const int G1 = N1 / W * KS1, G2 = N2 / W * KS2;
    std::vector<uint64_t> want;
    for (int e = 0; e < E; ++e)  // m-tiles are numbered expert-major, so a walk over experts is tile order
      for (int mt = 0; mt < base[e + 1] - base[e]; ++mt)
        for (int nf = 0; nf < G1; ++nf) want.push_back(enc(MK_TASK_GEMM1, e, mt, nf * W, base[e] + mt, KS1));
    for (int e = 0; e < E; ++e)
      for (int mt = 0; mt < base[e + 1] - base[e]; ++mt)
        for (int nf = 0; nf < G2; ++nf) want.push_back(enc(MK_TASK_GEMM2, e, mt, nf * W, base[e] + mt, KS2));
    for (int c = 0; c < n_ct; ++c)
      for (int cb = 0; cb < NC; ++cb) want.push_back(enc(MK_TASK_COMBINE, 0, c, cb, 0));
    for (int i = 0; i < (int)want.size(); ++i)
      CHECK(queue_word(i, base.data(), E, G1, KS1, G2, KS2, NC, W) == want[i], "queue_word trial %d slot %d", trial, i);
  }
  // 11. the staged epilogue: stmatrix x4 number m of chunk ch, then the lanes' 16-byte copy-out, put accumulator
  //     (warp row, column) of the fragment (acc_row / acc_col, register i = 4 j + 2 half) where the copy-out reads
  //     that row's column; no two values share a byte pair, and neither side has bank conflicts
  for (uint32_t ch = 0; ch < 4; ++ch) {
    std::vector<int> buf(2048 / 2, -1);  // buffer element (2 bytes) -> the column it holds, per row below
    std::vector<int> brow(2048 / 2, -1);
    for (uint32_t m = 0; m < 4; ++m) {
      // stmatrix semantics: matrix q's row rr (0..7) goes to the address lane 8 q + rr gives; its element c comes
      // from thread 4 rr + c / 2, register q, half c % 2
      for (uint32_t q = 0; q < 4; ++q) {
        std::set<uint32_t> banks;
        for (uint32_t r8 = 0; r8 < 8; ++r8) {
          const uint32_t lane = 8 * q + r8, row = stsm_row(lane), unit = stsm_unit(m, lane);
          const uint32_t off = stage_out_off(row, unit);
          CHECK(off % 16 == 0 && off + 16 <= 2048, "stsm address ch=%u m=%u lane=%u", ch, m, lane);
          banks.insert((off / 16) % 8);
          for (uint32_t c = 0; c < 8; ++c) {
            const uint32_t t = 4 * r8 + c / 2;  // the thread holding the element (lane within the warp)
            const uint32_t j = stsm_group(ch, m, q), i = 4 * j + 2 * (q & 1) + (c & 1);
            const uint32_t fr = acc_row(t, i), fc = acc_col(t, i);  // what the fragment says register i holds
            CHECK(fr == row && fc == 64 * ch + 8 * unit + c, "fragment ch=%u m=%u q=%u r=%u c=%u: (%u, %u)", ch, m, q,
                  r8, c, fr, fc);
            const uint32_t e = (off + 2 * c) / 2;
            CHECK(buf[e] < 0, "byte pair written twice ch=%u off=%u", ch, off + 2 * c);
            buf[e] = (int)fc;
            brow[e] = (int)fr;
          }
        }
        CHECK(banks.size() == 8, "stmatrix rows share bank groups ch=%u m=%u q=%u", ch, m, q);
      }
    }
    // copy-out: lane l, k = 0..3 reads unit l & 7 of row l / 8 + 4 k -> global columns 64 ch + 8 (l & 7) ..
    for (uint32_t k = 0; k < 4; ++k) {
      std::set<uint32_t> groups;
      for (uint32_t lane = 0; lane < 32; ++lane) {
        const uint32_t row = (lane >> 3) + 4 * k, unit = lane & 7, off = stage_out_off(row, unit);
        groups.insert(off / 16 % 8 + 8 * (lane >> 3));
        for (uint32_t c = 0; c < 8; ++c)
          CHECK(buf[(off + 2 * c) / 2] == (int)(64 * ch + 8 * unit + c) && brow[(off + 2 * c) / 2] == (int)row,
                "copy-out ch=%u row=%u unit=%u c=%u", ch, row, unit, c);
      }
      CHECK(groups.size() == 32, "copy-out bank groups k=%u", k);  // each row's 8 units in distinct bank groups
    }
  }
  // 12. tail rows (MkParams.tail_rows): expert_tiles / tile_end as schedule.py's (test_tail_rows_rule's values), and
  // for every count the m-tiles cover its rows once, in order, each of 1 .. bm + tail rows
  {
    const int cnts[] = {0, 1, 16, 127, 128, 129, 144, 145, 256, 257, 272, 273};
    const int want[] = {0, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 3};
    for (int i = 0; i < 12; ++i) CHECK(expert_tiles(cnts[i], 128, 16) == want[i], "expert_tiles(%d)", cnts[i]);
    for (int tail = 0; tail <= 16; ++tail)
      for (int c = 0; c < 600; ++c) {
        const int n = expert_tiles(c, 128, tail);
        int prev = 0;
        for (int mt = 0; mt < n; ++mt) {
          const int end = tile_end(c, mt, 128, tail);
          CHECK(prev == mt * 128 && end - prev >= 1 && end - prev <= 128 + tail, "tile_end(%d, %d, %d)", c, mt, tail);
          prev = end;
        }
        CHECK(prev == c, "tiles of %d rows (tail %d) end at %d", c, tail, prev);
      }
  }
  // 13. one expert's m-tiles (check_params' bound): MAX_EXPERT_TILES is the m-tile field's range (its last value
  // round-trips, one more spills into the expert's bits), and expert_tiles_max bounds expert_tiles for every count up
  // to S_cap, whatever the tail (equal without one)
  {
    const uint64_t last = enc(MK_TASK_GEMM1, 3, (int)(MAX_EXPERT_TILES - 1), 5, 7);
    CHECK(t_mtile(last) == MAX_EXPERT_TILES - 1 && t_expert(last) == 3, "last m-tile %d", t_mtile(last));
    const uint64_t over = enc(MK_TASK_GEMM1, 2, (int)MAX_EXPERT_TILES, 5, 7);  // reads as m-tile 0 of expert 3
    CHECK(t_mtile(over) == 0 && t_expert(over) == 3, "m-tile %lld: mt=%d e=%d", (long long)MAX_EXPERT_TILES,
          t_mtile(over), t_expert(over));
    for (int bm : {16, 64, 128})
      for (int s_cap : {0, 1, 15, 16, 17, 128, 129, 1000}) {
        CHECK(expert_tiles_max(s_cap, bm) == (s_cap + bm - 1) / bm, "expert_tiles_max(%d, %d)", s_cap, bm);
        for (int c = 0; c <= s_cap; ++c)
          for (int tail : {0, 1, 16}) {
            const int n = expert_tiles(c, bm, tail);
            CHECK(n <= expert_tiles_max(s_cap, bm) && (tail || c < s_cap || n == expert_tiles_max(s_cap, bm)),
                  "expert_tiles(%d, %d, %d) = %d vs S_cap %d", c, bm, tail, n, s_cap);
          }
      }
    CHECK(expert_tiles_max(MAX_EXPERT_TILES * 16, 16) == MAX_EXPERT_TILES &&
              expert_tiles_max(MAX_EXPERT_TILES * 16 + 1, 16) == MAX_EXPERT_TILES + 1,
          "expert_tiles_max at the bound");
  }
  printf("ok %ld\n", n_checks);
  return 0;
}
