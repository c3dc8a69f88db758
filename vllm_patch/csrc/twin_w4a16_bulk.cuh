// The W4A16 decode GEMM fed by the Tensor Memory Accelerator (SM 9.0: cp.async.bulk, mbarrier): the same
// layout, math and split-K epilogue as twin_w4a16.cuh's w4a16_decode; only how the weights arrive differs.
//
// Why: under Nsight Compute (H100, 32B layer set, M = 1) w4a16_decode waits on memory (long_scoreboard the
// largest stall) at 9-15 % occupancy. A ring of weights in shared memory alone (this kernel's first version:
// 16 KB a warp, 3 CTAs an SM) was no faster (H100, 32B layer set at M = 1: 138.7 against 122.4 µs): a warp
// went through a chunk in ~700 cycles, the latency of its x load under a saturated memory system, issued one
// chunk ahead. So x comes with the weights: each stage holds R row tiles' CH chunks (one bulk copy a tile:
// CH x 512 contiguous bytes of the layout) and the token block's x rows over those chunks (one bulk copy a
// row), completion counted in bytes on the slot's mbarrier; a warp's ring is up to 18 KB (D = 2 .. 16 stages
// by M), registers hold one chunk, so 3 CTAs an SM fit.
//
// Per warp, per stage q of its split: wait on its slot's barrier (parity: the ring's lap), read each chunk's
// 16 bytes a lane and x from shared memory and compute as w4a16_decode does; then (the warp's reads are done:
// the MMAs used them) lane 0 orders them before the async proxy's writes and refills the slot with stage q + D.
// Under programmatic dependent launch the first ring's weights are requested before the wait, its x after.
#pragma once

#include "twin_w4a16.cuh"

namespace twin_w4 {

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count) : "memory");
#endif
}

// the barriers' initialisation visible to the async proxy (the bulk copies complete on them)
__device__ __forceinline__ void mbar_init_fence() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}

// one arrival that also expects `bytes` of transactions (the stage's bulk copies) before the phase completes
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes)
               : "memory");
#endif
}

__device__ __forceinline__ bool mbar_try_wait(uint64_t* bar, uint32_t parity) {
  uint32_t ok = 1;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(ok)
      : "r"(smem_u32(bar)), "r"(parity)
      : "memory");
#endif
  return ok != 0;
}

__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  while (!mbar_try_wait(bar, parity)) {
  }
}

// the warp's generic-proxy reads of a slot ordered before the async proxy's next writes into it
__device__ __forceinline__ void fence_proxy_async() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// `bytes` (a multiple of 16, both addresses 16-byte aligned) from global to shared memory by the TMA unit,
// completing on `bar`; the weights are read once: evict them from L2 first
__device__ __forceinline__ void bulk_g2s(void* dst, const void* src, uint32_t bytes, uint64_t* bar,
                                         uint64_t policy) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;\n"
      ::"r"(smem_u32(dst)), "l"(src), "r"(bytes), "r"(smem_u32(bar)), "l"(policy)
      : "memory");
#endif
}

// the same without a cache hint (x: read by every warp of the CTA, and by the next GEMM's kernel as its y)
__device__ __forceinline__ void bulk_g2s(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
               ::"r"(smem_u32(dst)), "l"(src), "r"(bytes), "r"(smem_u32(bar))
               : "memory");
#endif
}

__device__ __forceinline__ uint64_t evict_first_policy() {
  uint64_t policy = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
#endif
  return policy;
}

template <int R>
__host__ __device__ constexpr int bulk_chunks() {  // chunks a stage holds of each row tile (even: a group 128)
  return R == 1 ? 4 : 2;
}

constexpr int kBulkMaxDepth = 16;            // stages a warp's ring may have (its barriers are static)
constexpr int kBulkWarpBytes = 18 * 1024;    // shared memory a warp may take (ring and meta): 3 CTAs an SM

// A stage of R row tiles' CH chunks and of the token block's x rows over those chunks (rows: M, at most 8 NT;
// each row padded by 16 bytes, so the 8 rows a warp's lanes read fall in distinct banks)
template <int R, int NT>
__host__ __device__ constexpr int bulk_stage_bytes(int m) {
  return R * bulk_chunks<R>() * 512 + (m < 8 * NT ? m : 8 * NT) * (bulk_chunks<R>() * 128 + 16);
}

// A warp's scales and zero points of its split: [R][groups][8 scale words, then (zero points) 2 words of 8 bytes
// and 2 of padding: 16-byte aligned records]
template <int R, int GS, bool HAS_Z>
__host__ __device__ constexpr int bulk_meta_bytes(int cps) {
  return R * ((cps * 2 + GS - 1) / GS) * (HAS_Z ? 48 : 32);
}

template <int R, int NT>
__host__ __device__ constexpr int bulk_depth(int m, int meta) {  // stages in a warp's ring, 2 .. kBulkMaxDepth
  const int d = (kBulkWarpBytes - meta) / bulk_stage_bytes<R, NT>(m);
  return d > kBulkMaxDepth ? kBulkMaxDepth : d < 2 ? 2 : d;
}

// A stage in shared memory: the weights [R][CH][32 lanes] (16 bytes each), then x [rows][CH][8] (16 bytes each).
// Its x comes by bulk copies too, with the weights: x read one chunk ahead from global memory waits on L2
// every chunk under a saturated memory system.
template <int R, int NT, int GS, bool HAS_Z>
__global__ void __launch_bounds__(kWarps * 32, 3) w4a16_decode_bulk(const Params p) {
  constexpr int CH = bulk_chunks<R>();
  constexpr int WQ = R * CH * 32;        // uint4s of a stage's weights
  static_assert(CH % 2 == 0, "a stage holds whole groups of 128");
  extern __shared__ __align__(128) uint4 ring_smem[];
  __shared__ __align__(8) uint64_t bars[kWarps][kBulkMaxDepth];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int tile0 = (blockIdx.x * kWarps + warp) * R;
  const int c_begin = blockIdx.y * p.cps, nck = min(p.cps, p.C - c_begin);
  const int m0 = blockIdx.z * 8 * NT;
  const int rows = min(8 * NT, p.M - m0);              // the token block's x rows
  constexpr int XR = CH * 8 + 1;                        // uint4s of an x row in a stage (16 bytes of padding)
  const int SQ = WQ + min(8 * NT, p.M) * XR;            // uint4s of a stage (x sized for the fullest block)
  const int D = p.ring;
  const int GSPL = (p.cps * 2 + GS - 1) / GS;           // groups of a split
  constexpr int MWG = HAS_Z ? 12 : 8;  // meta words of a (row tile, group): 8 scale pairs, 8 zero-point bytes, pad
  const bool active = tile0 < p.T && nck > 0;
  if (p.pdl) pdl_launch_dependents();
  float acc[R][NT][4];
  zero_acc<R, NT>(acc);

  if (active) {
    uint4* ring = ring_smem + (size_t)warp * D * SQ;  // [D][SQ]
    uint64_t* bar = bars[warp];
    int tiles[R];
    const uint4* wp[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      tiles[r] = min(tile0 + r, p.T - 1);
      wp[r] = static_cast<const uint4*>(p.qw) + ((size_t)tiles[r] * p.C + c_begin) * 32;
    }
    const __nv_bfloat16* xb = static_cast<const __nv_bfloat16*>(p.x) + (size_t)m0 * p.ldx + (size_t)c_begin * 64;
    const int ns = (nck + CH - 1) / CH;  // stages of the split
    const uint64_t policy = evict_first_policy();
    // lane 0: stage q's barrier expects its bytes, then its weights (R bulk copies of CH x 512 contiguous bytes)
    auto issue_w = [&](int q, int slot) {
      const int n = min(CH, nck - q * CH);
      mbar_arrive_expect_tx(bar + slot, (uint32_t)(R * n * 512 + rows * n * 128));
#pragma unroll
      for (int r = 0; r < R; ++r)
        bulk_g2s(ring + (size_t)slot * SQ + r * CH * 32, wp[r] + (size_t)q * CH * 32, (uint32_t)(n * 512),
                 bar + slot, policy);
    };
    // ... and its x rows (n x 128 contiguous bytes each); only once the kernel before has written x
    auto issue_x = [&](int q, int slot) {
      const int n = min(CH, nck - q * CH);
      for (int m = 0; m < rows; ++m)
        bulk_g2s(ring + (size_t)slot * SQ + WQ + m * XR, xb + (size_t)m * p.ldx + (size_t)q * CH * 64,
                 (uint32_t)(n * 128), bar + slot);
    };
    const int pre = min(D, ns);
    if (lane == 0) {
      for (int s = 0; s < D; ++s) mbar_init(bar + s, 1);
      mbar_init_fence();
      for (int q = 0; q < pre; ++q) issue_w(q, q);
    }
    // the split's scales and zero points into shared memory, all at once (cp.async): read one span ahead from
    // global memory (as w4a16_decode does), a warp waited on DRAM at every span
    uint32_t* meta = reinterpret_cast<uint32_t*>(ring_smem + (size_t)kWarps * D * SQ) + (size_t)warp * R * GSPL * MWG;
    {
      const int grp0 = c_begin * 2 / GS, ng = (nck * 2 + GS - 1) / GS;
      for (int u = lane; u < R * ng * 2; u += 32) {  // scales: two 16-byte halves of a (tile, group)
        const int r = u / (ng * 2), gl = (u >> 1) % ng;
        const size_t at = ((size_t)tiles[r] * p.NG + min(grp0 + gl, p.NG - 1)) * 8 + 4 * (u & 1);
        cp_async_b16(meta + (r * GSPL + gl) * MWG + 4 * (u & 1), static_cast<const uint32_t*>(p.sc) + at);
      }
      if (HAS_Z)
        for (int u = lane; u < R * ng; u += 32) {  // zero points: 8 bytes of a (tile, group)
          const int r = u / ng, gl = u % ng;
          const size_t at = ((size_t)tiles[r] * p.NG + min(grp0 + gl, p.NG - 1)) * 8;
          cp_async_b8(meta + (r * GSPL + gl) * MWG + 8, static_cast<const uint8_t*>(p.zp) + at);
        }
    }
    if (p.pdl) pdl_wait();  // x (written by the kernel before) only below; the weights are on their way
    if (lane == 0)
      for (int q = 0; q < pre; ++q) issue_x(q, q);
    cp_async_all();
    __syncwarp();
    uint32_t az[R][4];
    float P[R][NT][4];
    int slot = 0;
    uint32_t phase = 0;
    for (int q = 0; q < ns; ++q) {
      mbar_wait(bar + slot, phase);
      const uint4* st = ring + (size_t)slot * SQ;
#pragma unroll
      for (int j = 0; j < CH; ++j) {
        const int c = q * CH + j;
        if (c < nck) {
          uint4 w[R];
#pragma unroll
          for (int r = 0; r < R; ++r) w[r] = st[(r * CH + j) * 32 + lane];
          uint4 xv[NT][2];  // lane (g, t): x row g of each token tile, 16 bytes at k 8t and 32 + 8t
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) {
            const uint4* xr = st + WQ + min(8 * nt + g, rows - 1) * XR + j * 8;
            xv[nt][0] = xr[t];
            xv[nt][1] = xr[4 + t];
          }
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int gl = (2 * c + (i >> 1)) / GS;  // the step's group, within the split
            const bool first = GS == 1 ? (i & 1) == 0 : GS == 2 ? i == 0 : (i == 0 && (j & 1) == 0);
            const bool last = GS == 1 ? (i & 1) == 1 : GS == 2 ? i == 3 : (i == 3 && (j & 1) == 1);
            if (first) {
#pragma unroll
              for (int r = 0; r < R; ++r) {
                const uint32_t* mg = meta + (r * GSPL + gl) * MWG;
                zero_words<HAS_Z>(HAS_Z ? (mg[8 + (g >> 2)] >> (8 * (g & 3))) & 0xFFu : 0u, az[r]);
              }
              step<R, NT, true>(i, w, xv, P, az);
            } else {
              step<R, NT, false>(i, w, xv, P, az);
            }
            if (last) {
              uint32_t s1[R];
#pragma unroll
              for (int r = 0; r < R; ++r) s1[r] = meta[(r * GSPL + gl) * MWG + g];
              fold<R, NT>(acc, P, s1);
            }
          }
        }
      }
      __syncwarp();  // every lane's reads of the slot are done (the MMAs above consumed them)
      if (lane == 0 && q + D < ns) {
        fence_proxy_async();
        issue_w(q + D, slot);
        issue_x(q + D, slot);
      }
      if (++slot == D) {
        slot = 0;
        phase ^= 1u;
      }
    }
  }
  if (!active && p.pdl) pdl_wait();  // the epilogue's counters are shared with the kernel before
  epilogue<R, NT>(p, acc, tile0, active, m0, g, t);
}

#ifndef __CUDACC_RTC__
template <int R, int NT, int GS, bool HAS_Z>
void launch_bulk(const Params& p0, dim3 grid, cudaStream_t stream) {
  Params p = p0;
  const int meta = (bulk_meta_bytes<R, GS, HAS_Z>(p.cps) + 15) / 16 * 16;
  p.ring = bulk_depth<R, NT>(p.M, meta);
  const int smem = kWarps * (p.ring * bulk_stage_bytes<R, NT>(p.M) + meta);
  launch_kernel(w4a16_decode_bulk<R, NT, GS, HAS_Z>, p, grid, smem, stream);
}

#define TWIN_W4_INSTANTIATE_BULK(R, NT, GS, HZ) \
  template void launch_bulk<R, NT, GS, HZ>(const Params&, dim3, cudaStream_t);
#endif
#define TWIN_W4_INSTANTIATE_BULK_KERNEL(R, NT, GS, HZ) \
  template __global__ void w4a16_decode_bulk<R, NT, GS, HZ>(const Params);

}  // namespace twin_w4
