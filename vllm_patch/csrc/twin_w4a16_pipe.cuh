// The W4A16 decode GEMM with its loads staged in shared memory (cp.async): the same layout, math and split-K
// epilogue as twin_w4a16.cuh's w4a16_decode, for R = 1 or 2 row tiles a warp.
//
// Why: under Nsight Compute (H100, 32B layer set, M = 1) w4a16_decode waits on memory (long_scoreboard the
// largest stall) at 9-15 % occupancy, its load ring held in registers (167-255 a thread, 2 CTAs an SM). Here
// each warp keeps S chunks in flight in shared memory instead (S: as many as 48 KB a CTA holds, 2-8): its
// weights (R x 512 B a chunk, each lane its own 16 B), the chunk's x rows (only the batch's rows) and the
// scales / zero points of the chunk's groups, all by cp.async, S - 1 chunks ahead; registers hold one chunk
// (86-148 a thread), so 3 CTAs an SM fit. Not yet run on a GPU.
//
// Per warp, per chunk c of its split: wait for chunk c's copies, read them into registers, issue chunk
// c + S - 1 into the slot chunk c - 1 used (every lane has read it: the __syncwarp after the wait), compute.
// x and the scales are shared across lanes (lane g reads row g, scale g), so a __syncwarp follows each wait.
#pragma once

#include "twin_w4a16.cuh"

namespace twin_w4 {

__device__ __forceinline__ void cp_async4(void* smem, const void* gmem) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem_u32(smem)), "l"(gmem));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// One chunk of one warp in shared memory. EC: groups a chunk touches (group 32: 2, else 1).
template <int R, int NT, int EC>
struct PipeStage {
  uint4 w[R][32];           // lane l's 16 B of each row tile
  uint4 x[8 * NT][8];       // x rows of the CTA's token block: 64 bf16 a chunk, 8 pieces of 16 B
  uint32_t sc[R][EC][8];    // bf16 scale pairs of rows g, g + 8 (as the layout stores them)
  uint32_t zp[R][EC][2];    // zero points: byte g of the 8 bytes of a (tile, group)
};

template <int R, int NT, int GS>
__host__ __device__ constexpr int pipe_stages() {  // as many as fit 48 KB of static shared memory (2 to 8)
  constexpr int EC = GS == 1 ? 2 : 1;
  constexpr int bytes = (int)sizeof(PipeStage<R, NT, EC>) * kWarps;
  constexpr int fit = (48 * 1024 - 64) / bytes;  // the epilogue's flag takes a few bytes
  return fit > 8 ? 8 : fit < 2 ? 2 : fit;
}

template <int R, int NT, int GS, bool HAS_Z>
__global__ void __launch_bounds__(kWarps * 32, 3) w4a16_decode_pipe(const Params p) {
  constexpr int EC = GS == 1 ? 2 : 1;
  constexpr int S = pipe_stages<R, NT, GS>();
  static_assert(R == 1 || R == 2, "the staged kernel holds one or two row tiles a warp");
  __shared__ PipeStage<R, NT, EC> stages[kWarps][S];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int tile0 = (blockIdx.x * kWarps + warp) * R;
  const int c_begin = blockIdx.y * p.cps, nck = min(p.cps, p.C - c_begin);
  const int m0 = blockIdx.z * 8 * NT;
  const int rows = min(8 * NT, p.M - m0);  // x rows of the token block that exist
  const bool active = tile0 < p.T && nck > 0;
  float acc[R][NT][4];
  zero_acc<R, NT>(acc);

  if (active) {
    PipeStage<R, NT, EC>* my = stages[warp];
    const uint4* wp[R];
#pragma unroll
    for (int r = 0; r < R; ++r)
      wp[r] = static_cast<const uint4*>(p.qw) + ((size_t)min(tile0 + r, p.T - 1) * p.C + c_begin) * 32 + lane;
    const __nv_bfloat16* xb = static_cast<const __nv_bfloat16*>(p.x) + (size_t)m0 * p.ldx + (size_t)c_begin * 64;

    // chunk c (of the split) into slot: every lane commits a group, empty past the split's end
    auto issue = [&](int c, int slot) {
      if (c < nck) {
        PipeStage<R, NT, EC>& st = my[slot];
#pragma unroll
        for (int r = 0; r < R; ++r) cp_async_b16(&st.w[r][lane], wp[r] + (size_t)c * 32);
        for (int q = lane; q < 8 * rows; q += 32)
          cp_async_b16(&st.x[q >> 3][q & 7], reinterpret_cast<const uint4*>(xb + (size_t)(q >> 3) * p.ldx) + c * 8 + (q & 7));
        const int grp = (c_begin + c) * 2 / GS;  // the chunk's first group
        for (int q = lane; q < R * EC * 8; q += 32) {
          const int r = q / (EC * 8), e = (q >> 3) % EC;
          const size_t at = ((size_t)min(tile0 + r, p.T - 1) * p.NG + min(grp + e, p.NG - 1)) * 8 + (q & 7);
          cp_async4(&st.sc[r][e][q & 7], static_cast<const uint32_t*>(p.sc) + at);
        }
        if (HAS_Z && lane < R * EC * 2) {
          const int r = lane / (EC * 2), e = (lane >> 1) % EC;
          const size_t at = ((size_t)min(tile0 + r, p.T - 1) * p.NG + min(grp + e, p.NG - 1)) * 2 + (lane & 1);
          cp_async4(&st.zp[r][e][lane & 1], static_cast<const uint32_t*>(p.zp) + at);
        }
      }
      cp_async_commit();
    };

#pragma unroll
    for (int j = 0; j < S - 1; ++j) issue(j, j);
    uint32_t az[R][EC][4];
    float P[R][NT][4];
    for (int c = 0; c < nck; ++c) {
      cp_async_wait<S - 2>();  // chunk c's group is complete (S - 2 newer ones may be in flight)
      __syncwarp();
      const int slot = c % S;
      const PipeStage<R, NT, EC>& st = my[slot];
      uint4 w[R];
#pragma unroll
      for (int r = 0; r < R; ++r) w[r] = st.w[r][lane];
      uint4 xq[NT][2];  // lane (g, t): x row g of each token tile, pieces t (steps 0-1) and 4 + t (steps 2-3)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const int row = min(8 * nt + g, rows - 1);
        xq[nt][0] = st.x[row][t];
        xq[nt][1] = st.x[row][4 + t];
      }
      uint32_t s[R][EC], zb[R][EC];
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int e = 0; e < EC; ++e) {
          s[r][e] = st.sc[r][e][g];
          zb[r][e] = HAS_Z ? (st.zp[r][e][g >> 2] >> (8 * (g & 3))) & 0xFFu : 0u;
        }
      issue(c + S - 1, (c + S - 1) % S);  // into the slot chunk c - 1 used: every lane read it before the wait
      const bool even = ((c_begin + c) & 1) == 0;  // group 128: a group's first chunk
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int e = GS == 1 ? i >> 1 : 0;
        const bool first = GS == 1 ? (i & 1) == 0 : GS == 2 ? i == 0 : (i == 0 && even);
        const bool last = GS == 1 ? (i & 1) == 1 : GS == 2 ? i == 3 : (i == 3 && !even);
        if (first)
#pragma unroll
          for (int r = 0; r < R; ++r) zero_words<HAS_Z>(zb[r][e], az[r][e]);
        uint32_t az1[R][4];
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
          for (int q = 0; q < 4; ++q) az1[r][q] = az[r][e][q];
        if (first)
          step<R, NT, true>(i, w, xq, P, az1);
        else
          step<R, NT, false>(i, w, xq, P, az1);
        if (last) {
          uint32_t s1[R];
#pragma unroll
          for (int r = 0; r < R; ++r) s1[r] = s[r][e];
          fold<R, NT>(acc, P, s1);
        }
      }
    }
    cp_async_wait<0>();
  }
  epilogue<R, NT>(p, acc, tile0, active, m0, g, t);
}

#ifndef __CUDACC_RTC__
template <int R, int NT, int GS, bool HAS_Z>
void launch_pipe(const Params& p, dim3 grid, cudaStream_t stream) {
  w4a16_decode_pipe<R, NT, GS, HAS_Z><<<grid, kWarps * 32, 0, stream>>>(p);
}

#define TWIN_W4_INSTANTIATE_PIPE(R, NT, GS, HZ) \
  template void launch_pipe<R, NT, GS, HZ>(const Params&, dim3, cudaStream_t);
#endif
#define TWIN_W4_INSTANTIATE_PIPE_KERNEL(R, NT, GS, HZ) \
  template __global__ void w4a16_decode_pipe<R, NT, GS, HZ>(const Params);

}  // namespace twin_w4
