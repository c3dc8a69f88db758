// W4A16 decode GEMM for the int4 twin: y[M, N] = x[M, K] @ dequant(W)[N, K]^T, bf16 in and out,
// fp32 accumulation, on the tensor cores (mma.sync m16n8k16 bf16, SM 8.0+; built for sm_90a).
//
// Layout (written by vllm_patch/twin_cuda_layout.py, which also emulates this file's index math):
//   qw [T][C][32][4] int32   T = ceil(N / 16) row tiles, C = K / 64 chunks, 32 lanes, 4 k16 steps.
//     Lane l (g = l / 4, t = l % 4), step i (sb = i / 2, ii = i % 2): k0 = 64 c + 32 sb + 8 t + 4 ii.
//     Nibble j = p + 4 h (bits 4j..4j+3) holds W[16 tile + g + 8 (p & 1)][k0 + 2 (p >> 1) + h]:
//     (v >> 4p) & 0x000F000F are the two nibbles of A-fragment register p (row g or g + 8).
//     A warp's 16-byte loads of one (tile, chunk) are 512 contiguous bytes; a tile is contiguous.
//   sc [T][NG][8] uint32     bf16 scales of rows g (low half) and g + 8 (high half), NG = K / group.
//   zp [T][NG][8] uint8      zero points: z[g] | z[g + 8] << 4 (absent for uint4b8: zero point 8).
//   B operand: the 16 k of step i are k0(t) + 0..3 over t = 0..3, so thread t reads x[token][k0 .. k0 + 3]:
//   one 16-byte load of x per 32-k sub-block serves two steps; a group (32, 64, 128, ...) is whole steps.
//   With one token tile and zero points, the CTA first stages its token rows of x over its split in shared
//   memory (cp.async; dynamic shared memory, rows padded by 16 bytes), and the warps read x from there.
//
// Dequant: lop3 (v & 0x000F000F) | 0x43004300 is the bf16 pair (128 + q_lo, 128 + q_hi), exact; with one token
// tile a second MMA per step with A_z = -(128 + z) of the row (bf16 0xC300 | z, exact) adds -(128 + z) sum_k x
// into the same fp32 accumulator, with two a bf16 add makes A = q - z (exact) first; either way P = sum_k
// (q - z) x per group, and acc += s P at the group's end.
#pragma once

#include <cuda_bf16.h>
#ifndef __CUDACC_RTC__  // NVRTC (the CPU compile check, twin_cuda_compile.py) has no <stdint.h>: it defines them
#include <stdint.h>
#endif

#include "twin_w4a16_api.h"

namespace twin_w4 {


__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// x: an ordinary (coherent) load, never the read-only path (ld.global.nc, __ldg). Under programmatic dependent
// launch x is written by the kernel before this one while this one starts, so it is not read-only for this
// kernel's lifetime, and ptxas moved the read-only loads of x above the wait (griddepcontrol.wait orders the
// coherent loads after it).
__device__ __forceinline__ uint4 ld_x(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ uint32_t smem_u32(const void* p) {  // a shared-memory address for PTX
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 / 8 bytes from global to shared memory by the thread (cp.async, SM 8.0+), completed by cp_async_all()
__device__ __forceinline__ void cp_async_b16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_u32(dst)), "l"(src) : "memory");
}

__device__ __forceinline__ void cp_async_b8(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(smem_u32(dst)), "l"(src) : "memory");
}

__device__ __forceinline__ void cp_async_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

// Programmatic dependent launch (SM 9.0+; no-ops below, and when the grid was launched without the attribute):
// wait until the grids this one depends on have completed and their writes are visible; let the grids that
// depend on this one be scheduled once every CTA of it has said so (or ended).
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

__device__ __forceinline__ uint32_t bf16_pair(uint32_t v) {  // (v & 0x000F000F) | 0x43004300
  uint32_t d;
  asm("lop3.b32 %0, %1, 0x000F000F, 0x43004300, 0xEA;\n" : "=r"(d) : "r"(v));
  return d;
}

__device__ __forceinline__ void mma_bf16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// mma_bf16 with a zero accumulator in.
__device__ __forceinline__ void mma_bf16_zero(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                              uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%10, %10, %10, %10};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "f"(0.0f));
}

__device__ __forceinline__ uint32_t word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// (a + c) of bf16 pairs as fma(a, 1, c), rn (SM 8.0+): exact where the sums are small integers
__device__ __forceinline__ uint32_t bf16_add(uint32_t a, uint32_t c) {
  uint32_t d;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(0x3F803F80u), "r"(c));
  return d;
}

// P = A B (FIRST: from zero) or P += A B.
template <bool FIRST>
__device__ __forceinline__ void mma_acc(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                        uint32_t b0, uint32_t b1) {
  if (FIRST)
    mma_bf16_zero(d, a0, a1, a2, a3, b0, b1);
  else
    mma_bf16(d, a0, a1, a2, a3, b0, b1);
}

// One k16 step i of a chunk for R tiles and NT token tiles of 8. One token tile: P += A_z B + A B, where A
// holds 128 + q and A_z the row's -(128 + z) (bf16, exact): P sums (q - z) x over the group, the zero point
// on the tensor cores (each extra MMA an issue slot where four bf16 adds would be four). Two token tiles:
// A = (128 + q) + A_z = q - z (bf16, exact) first, then one MMA a token tile: with two tiles the
// A_z MMAs would be half the tensor work, the adds are shared by both tiles. FIRST: the group's first step,
// whose first MMA starts from zero.
template <int R, int NT, bool FIRST>
__device__ __forceinline__ void step(int i, const uint4 (&w)[R], const uint4 (&xv)[NT][2], float (&P)[R][NT][4],
                                     const uint32_t (&az)[R][4]) {
  constexpr bool SUBZ = NT > 1;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const uint32_t v = word(w[r], i);
    uint32_t a0 = bf16_pair(v), a1 = bf16_pair(v >> 4), a2 = bf16_pair(v >> 8), a3 = bf16_pair(v >> 12);
    if (SUBZ) {  // registers 0 and 2 hold row g, 1 and 3 row g + 8, as az's words do
      a0 = bf16_add(a0, az[r][0]);
      a1 = bf16_add(a1, az[r][1]);
      a2 = bf16_add(a2, az[r][2]);
      a3 = bf16_add(a3, az[r][3]);
    }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const uint4& xq = xv[nt][i >> 1];
      const uint32_t b0 = (i & 1) ? xq.z : xq.x, b1 = (i & 1) ? xq.w : xq.y;
      if (SUBZ) {
        mma_acc<FIRST>(P[r][nt], a0, a1, a2, a3, b0, b1);
      } else {
        mma_acc<FIRST>(P[r][nt], az[r][0], az[r][1], az[r][2], az[r][3], b0, b1);
        mma_bf16(P[r][nt], a0, a1, a2, a3, b0, b1);
      }
    }
  }
}

// The accumulators at zero.
template <int R, int NT>
__device__ __forceinline__ void zero_acc(float (&acc)[R][NT][4]) {
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[r][nt][c] = 0.0f;
}

// End of a group: acc += s * P per row (s: bf16 scales of rows g and g + 8).
template <int R, int NT>
__device__ __forceinline__ void fold(float (&acc)[R][NT][4], const float (&P)[R][NT][4], const uint32_t (&s)[R]) {
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const float s0 = __uint_as_float(s[r] << 16), s1 = __uint_as_float(s[r] & 0xFFFF0000u);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[r][nt][c] = fmaf(c < 2 ? s0 : s1, P[r][nt][c], acc[r][nt][c]);
  }
}

// Scales (raw bf16 pairs) and zero points of groups grp .. grp + E - 1 (clamped) for the warp's tiles.
template <int R, int E, bool HAS_Z>
__device__ __forceinline__ void load_meta(const Params& p, const int (&tiles)[R], int grp, int g,
                                          uint32_t (&s)[R][E], uint32_t (&z)[R][E]) {
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int e = 0; e < E; ++e) {
      const size_t at = ((size_t)tiles[r] * p.NG + min(grp + e, p.NG - 1)) * 8 + g;
      s[r][e] = __ldg(static_cast<const uint32_t*>(p.sc) + at);
      z[r][e] = HAS_Z ? (uint32_t)__ldg(static_cast<const uint8_t*>(p.zp) + at) : 0u;
    }
}

// The same into slot j of a ring of NM spans (the DEEP instances).
template <int R, int NM, int E, bool HAS_Z>
__device__ __forceinline__ void load_meta_slot(const Params& p, const int (&tiles)[R], int grp, int g, int j,
                                               uint32_t (&s)[R][NM][E], uint32_t (&z)[R][NM][E]) {
  uint32_t s1[R][E], z1[R][E];
  load_meta<R, E, HAS_Z>(p, tiles, grp, g, s1, z1);
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int e = 0; e < E; ++e) {
      s[r][j][e] = s1[r][e];
      z[r][j][e] = z1[r][e];
    }
}

// A_z fragment (rows g, g + 8, g, g + 8): bf16 pairs -(128 + z) = 0xC300 | z (uint4b8: z = 8).
template <bool HAS_Z>
__device__ __forceinline__ void zero_words(uint32_t zb, uint32_t (&az)[4]) {
  if (HAS_Z) {
    az[0] = az[2] = (zb & 15u) * 0x10001u + 0xC300C300u;
    az[1] = az[3] = (zb >> 4) * 0x10001u + 0xC300C300u;
  } else {
    az[0] = az[1] = az[2] = az[3] = 0xC308C308u;
  }
}

// silu(a) b of the gate and up sums, each rounded to bf16 first (what the unfused GEMM writes and vLLM's
// SiluAndMul reads), the product in fp32, rounded once
__device__ __forceinline__ __nv_bfloat16 silu_mul(float gate, float up) {
  const float a = __bfloat162float(__float2bfloat16_rn(gate)), b = __bfloat162float(__float2bfloat16_rn(up));
  return __float2bfloat16_rn(a / (1.0f + expf(-a)) * b);
}

// The CTA's partial sums: bf16 to y (S == 1), else fp32 to the workspace, and the last CTA of the row
// block to arrive adds the S partials in split order (deterministic) and resets its counter.
// p.act (R even): the layout's row tiles come in pairs, gate tile i at 2 i and up tile i at 2 i + 1
// (twin_cuda_layout.pair_tiles), and y [M, N / 2] gets silu(gate) * up of row 16 i + j: the MLP's
// gate_up GEMM and SiluAndMul in one kernel.
template <int R, int NT>
__device__ __forceinline__ void epilogue(const Params& p, const float (&acc)[R][NT][4], int tile0, bool active,
                                         int m0, int g, int t) {
  __nv_bfloat16* y = static_cast<__nv_bfloat16*>(p.y);
  if (active) {
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int row = 16 * (tile0 + r) + g + 8 * (c >> 1), tok = m0 + 8 * nt + 2 * t + (c & 1);
          if (row < p.N && tok < p.M) {
            if (p.S > 1)
              p.ws[((size_t)blockIdx.y * p.M + tok) * p.N + row] = acc[r][nt][c];
            else if (!p.act)
              y[(size_t)tok * p.ldy + row] = __float2bfloat16_rn(acc[r][nt][c]);
            else if constexpr (R % 2 == 0)
              if (r % 2 == 0)  // the gate tile; its up tile is r + 1, the same row within the tile
                y[(size_t)tok * p.ldy + 16 * ((tile0 + r) / 2) + g + 8 * (c >> 1)] =
                    silu_mul(acc[r][nt][c], acc[r + 1][nt][c]);
          }
        }
  }
  if (p.S == 1) return;
  __shared__ int last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    int* cnt = p.counters + blockIdx.z * gridDim.x + blockIdx.x;
    last = atomicAdd(cnt, 1) == p.S - 1;
    if (last) *cnt = 0;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  const int row0 = blockIdx.x * kWarps * R * 16, rows = min(kWarps * R * 16, p.N - row0);
  const int toks = min(8 * NT, p.M - m0);
  auto sum_of = [&](int row, int tok) {
    float sum = 0.0f;
    for (int sp = 0; sp < p.S; ++sp) sum += __ldcg(p.ws + ((size_t)sp * p.M + tok) * p.N + row);
    return sum;
  };
  if (!p.act) {
    for (int e = threadIdx.x; e < rows * toks; e += blockDim.x) {
      const int row = row0 + e % rows, tok = m0 + e / rows;
      y[(size_t)tok * p.ldy + row] = __float2bfloat16_rn(sum_of(row, tok));
    }
  } else {  // output rows of the block's tile pairs: gate row 32 i + j, up row 32 i + 16 + j -> row 16 i + j
    const int half = rows / 2;
    for (int e = threadIdx.x; e < half * toks; e += blockDim.x) {
      const int out = row0 / 2 + e % half, tok = m0 + e / half;
      const int gate = 32 * (out / 16) + out % 16;
      y[(size_t)tok * p.ldy + out] = silu_mul(sum_of(gate, tok), sum_of(gate + 16, tok));
    }
  }
}

template <int R, int GS>
__host__ __device__ constexpr int ring_depth() {  // chunks per ring: even, a multiple of the span
  return R == 1 ? 8 : 4;
}

// R: row tiles of 16 per warp; NT: token tiles of 8 (M <= 8: 1, else 2; gridDim.z covers more);
// GS: group / 32 (1, 2, 4); HAS_Z: zero points (uint4), else uint4b8. Every group boundary sits at a
// static step of the unrolled ring (splits start on a group, the ring is a multiple of the span).
// DEEP: the scales and zero points of a span are loaded from a ring of two weight rings' spans (2 RD / SPAN
// slots, each refilled NM spans ahead, further ahead than the weights), else one span ahead: they come from
// DRAM like the weights, and at 9-15 % occupancy a wait on them is not hidden (Nsight Compute, H100).
template <int R, int NT, int GS, bool HAS_Z, bool DEEP>
__global__ void __launch_bounds__(kWarps * 32, 2) w4a16_decode(const Params p) {
  constexpr int RD = ring_depth<R, GS>();
  constexpr int E = GS == 1 ? 2 : 1;     // groups whose meta a span needs
  constexpr int SPAN = GS == 4 ? 2 : 1;  // chunks per span
  constexpr int UNR = DEEP ? 2 : 1;          // weight rings a pass of the unrolled loop covers
  constexpr int NM = UNR * RD / SPAN;        // DEEP: meta ring slots (spans), 2 rings' worth
  constexpr bool STAGE = NT == 1 && HAS_Z;  // x staged in shared memory (one token tile, zero points)
  static_assert(RD % 2 == 0 && RD % SPAN == 0, "ring depth");
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int tile0 = (blockIdx.x * kWarps + warp) * R;
  const int c_begin = blockIdx.y * p.cps, nck = min(p.cps, p.C - c_begin);
  const int m0 = blockIdx.z * 8 * NT;
  const bool active = tile0 < p.T && nck > 0;
  // launched as a programmatic dependent itself, the kernel lets the next one (if launched so too) start its
  // own weight loads once every CTA of this grid is resident: that one waits for this grid's end before it
  // reads y. A plain launch keeps the plain order for whatever follows.
  if (p.pdl) pdl_launch_dependents();
  float acc[R][NT][4];
  zero_acc<R, NT>(acc);
  extern __shared__ __align__(16) uint4 xs[];  // the CTA's x rows over its split: [rows][XRS]
  const int rows = min(8 * NT, p.M - m0);
  const int XRS = p.cps * 8 + 1;  // uint4s of a staged row (16 bytes of padding: rows in distinct banks)

  int tiles[R];
  const uint4* wp[R];
  uint4 buf[RD][R];
  int grp = c_begin * 2 / GS;  // the split's first group: span sp holds groups grp + E sp ..
  uint32_t s_cur[R][E], z_cur[R][E], s_nxt[R][E], z_nxt[R][E], az[R][E][4];
  uint32_t sm[R][NM][E], zm[R][NM][E];  // DEEP
  if (active) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      tiles[r] = min(tile0 + r, p.T - 1);
      wp[r] = static_cast<const uint4*>(p.qw) + ((size_t)tiles[r] * p.C + c_begin) * 32 + lane;
    }
#pragma unroll
    for (int d = 0; d < RD; ++d)
      if (d < nck)
#pragma unroll
        for (int r = 0; r < R; ++r) buf[d][r] = ld_stream(wp[r] + d * 32);
    if constexpr (DEEP) {
#pragma unroll
      for (int j = 0; j < NM; ++j) load_meta_slot<R, NM, E, HAS_Z>(p, tiles, grp + j * E, g, j, sm, zm);
    } else {
      load_meta<R, E, HAS_Z>(p, tiles, grp, g, s_cur, z_cur);
      load_meta<R, E, HAS_Z>(p, tiles, grp + E, g, s_nxt, z_nxt);
    }
  }
  // Launched as a programmatic dependent (p.pdl), the kernel waits for the kernel before it (which writes x)
  // here: the weights, scales and zero points, the model's, are loaded above, so that they stream in while
  // that kernel ends; x and everything written (y, the split-K workspace and counters) only below. ptxas
  // schedules the wait as early as it may (the ring's loads written above it sank below it), so the wait
  // hangs on a branch on a word of each load, always taken (M >= 1 in every launch).
  if (p.pdl) {
    uint32_t dep = static_cast<uint32_t>(p.M > 0);
    if (active)
#pragma unroll
      for (int d = 0; d < RD; ++d)
        if (d < nck)
#pragma unroll
          for (int r = 0; r < R; ++r) dep |= buf[d][r].x;
    if (dep != 0u) pdl_wait();
  }
  // x of the CTA's token block over its split, into shared memory by the whole CTA (cp.async), once (STAGE):
  // read from global memory one chunk ahead, every chunk of a warp waited on an L2 round trip under a saturated
  // memory system (a probe of this loop on the H100: 62 µs on the 32B gate_up against 48 µs with x in registers
  // and 46 µs for the loads alone). Measured on the H100's 32B layer set, staged against read one chunk ahead:
  // zero points, M = 1: 112-116 against 122-124 µs. Only there; elsewhere x is read from global memory:
  // - symmetric weights, M = 1: staged 130.6 against 120-122 µs (ptxas schedules that instance's loop
  //   differently; not understood);
  // - two token tiles (M > 8), layer set at M = 16 against x read one chunk ahead (167-169 µs): 16 rows staged
  //   before the first chunk 244 (against 205 then); a ring per warp, each lane copying its own pieces 488; x two
  //   chunks ahead in registers 168.7; x prefetched into L1 four chunks ahead 213; a TMA-filled ring 275
  //   (symmetric); the whole CTA copying 8-chunk blocks into a two-block ring, one barrier a block, 215. At 16
  //   tokens the HMMAs wait on x (43-56 % of Nsight Compute's samples), but every form of x in shared memory so
  //   far costs more in issue slots and barriers than that wait (docs/benchmarks.md).
  if constexpr (STAGE) {
    const __nv_bfloat16* xg = static_cast<const __nv_bfloat16*>(p.x) + (size_t)m0 * p.ldx + (size_t)c_begin * 64;
    const int per_row = max(nck, 0) * 8;
    for (int u = threadIdx.x; u < rows * per_row; u += kWarps * 32) {
      const int row = u / per_row, pc = u - row * per_row;
      cp_async_b16(xs + row * XRS + pc, reinterpret_cast<const uint4*>(xg + (size_t)row * p.ldx) + pc);
    }
    cp_async_all();
    __syncthreads();
  }

  if (active) {
    // lane (g, t): x of token g of each token tile at its 16 bytes t, chunk c at 8 c (staged or in global memory)
    const uint4* xr[NT];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
      xr[nt] = STAGE ? xs + min(8 * nt + g, rows - 1) * XRS + t
                     : reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(p.x) +
                                                      (size_t)min(m0 + g + 8 * nt, p.M - 1) * p.ldx) +
                           (size_t)c_begin * 8 + t;
    auto load_x = [&](int nt, int off) -> uint4 {
      if constexpr (STAGE)
        return xr[nt][off];
      else
        return ld_x(xr[nt] + off);
    };
    uint4 xv[2][NT][2];  // x of chunks of even / odd ring slots
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      xv[0][nt][0] = load_x(nt, 0);
      xv[0][nt][1] = load_x(nt, 4);
    }
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int e = 0; e < E; ++e) zero_words<HAS_Z>(DEEP ? zm[r][0][e] : z_cur[r][e], az[r][e]);
    float P[R][NT][4];
    for (int c0 = 0; c0 < nck; c0 += UNR * RD) {
#pragma unroll
      for (int du = 0; du < UNR * RD; ++du) {
        const int d = du % RD;  // the weight ring's slot
        const int c = c0 + du;
        const int j = du / SPAN;  // DEEP: the span's meta slot (static: the loop is unrolled)
        if (c < nck) {
          const int cn = min(c + 1, nck - 1);  // x of the next chunk, one chunk ahead
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) {
            xv[(d + 1) & 1][nt][0] = load_x(nt, 8 * cn);
            xv[(d + 1) & 1][nt][1] = load_x(nt, 8 * cn + 4);
          }
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int e = GS == 1 ? i >> 1 : 0;
            uint32_t az1[R][4];
#pragma unroll
            for (int r = 0; r < R; ++r)
#pragma unroll
              for (int q = 0; q < 4; ++q) az1[r][q] = az[r][e][q];
            const bool first = GS == 1 ? (i & 1) == 0 : GS == 2 ? i == 0 : (i == 0 && (d & 1) == 0);
            const bool last = GS == 1 ? (i & 1) == 1 : GS == 2 ? i == 3 : (i == 3 && (d & 1) == 1);
            if (first)
              step<R, NT, true>(i, buf[d], xv[d & 1], P, az1);
            else
              step<R, NT, false>(i, buf[d], xv[d & 1], P, az1);
            if (last) {
              uint32_t s1[R];
#pragma unroll
              for (int r = 0; r < R; ++r) s1[r] = DEEP ? sm[r][j][e] : s_cur[r][e];
              fold<R, NT>(acc, P, s1);
            }
          }
          if (c + RD < nck)
#pragma unroll
            for (int r = 0; r < R; ++r) buf[d][r] = ld_stream(wp[r] + (c + RD) * 32);
          if (d % SPAN == SPAN - 1) {  // the span's groups are folded: next span's meta
            if constexpr (DEEP) {  // the next slot's A_z; this slot takes the span NM ahead
#pragma unroll
              for (int r = 0; r < R; ++r)
#pragma unroll
                for (int e = 0; e < E; ++e) zero_words<HAS_Z>(zm[r][(j + 1) % NM][e], az[r][e]);
              load_meta_slot<R, NM, E, HAS_Z>(p, tiles, grp + (c0 / SPAN + j + NM) * E, g, j, sm, zm);
            } else {
#pragma unroll
              for (int r = 0; r < R; ++r)
#pragma unroll
                for (int e = 0; e < E; ++e) {
                  s_cur[r][e] = s_nxt[r][e];
                  zero_words<HAS_Z>(z_nxt[r][e], az[r][e]);
                }
              grp += E;
              load_meta<R, E, HAS_Z>(p, tiles, grp + E, g, s_nxt, z_nxt);
            }
          }
        }
      }
    }
  }
  epilogue<R, NT>(p, acc, tile0, active, m0, g, t);
}

// Dynamic shared memory of a launch: the staged x rows (one token tile with zero points: min(M, 8) of them, cps
// chunks each, padded); none otherwise
template <int NT, bool HAS_Z>
__host__ __device__ constexpr int x_stage_bytes(int m, int cps) {
  return NT == 1 && HAS_Z ? (m < 8 ? m : 8) * (cps * 8 + 1) * 16 : 0;
}

#ifndef __CUDACC_RTC__
// Launch `kern` with `smem` bytes of dynamic shared memory (the opt-in above 48 KB: per device, not a stream
// operation, so allowed under CUDA-graph capture), as a programmatic dependent of the work before it on the
// stream when p.pdl (SM 9.0+, in CUDA graphs too): its CTAs may start while that work ends, the kernel's
// pdl_wait() keeps its reads of x after it.
template <typename Kernel>
void launch_kernel(Kernel kern, const Params& p, dim3 grid, int smem, cudaStream_t stream) {
  if (smem > 48 * 1024) cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(kWarps * 32);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = p.pdl ? 1 : 0;
  cudaLaunchKernelEx(&cfg, kern, p);
}

template <int R, int NT, int GS, bool HAS_Z, bool DEEP>
void launch(const Params& p, dim3 grid, cudaStream_t stream) {
  launch_kernel(w4a16_decode<R, NT, GS, HAS_Z, DEEP>, p, grid, x_stage_bytes<NT, HAS_Z>(p.M, p.cps), stream);
}

#define TWIN_W4_INSTANTIATE(R, NT, GS, HZ, DP) \
  template void launch<R, NT, GS, HZ, DP>(const Params&, dim3, cudaStream_t);
#endif
// The kernel instances alone (device code: what NVRTC compiles)
#define TWIN_W4_INSTANTIATE_KERNEL(R, NT, GS, HZ, DP) \
  template __global__ void w4a16_decode<R, NT, GS, HZ, DP>(const Params);

}  // namespace twin_w4
