// Decode attention for the draft's single-token steps: one query token per request against its paged KV cache
// (vLLM's FlashAttention cache, any strides), grouped-query heads, head dim 128, bf16 in and out, fp32 softmax and sums.
//
// Why: in the draft's single-token step FlashAttention 3 takes two launches a layer (its split-KV kernel and the
// combine), 12 µs a layer at batch 1 on an H100 (8B shape, results/draft-profile/20261206T224809Z-h100-marlin-
// traced): 0.43 ms of a 3.4 ms step, where the bytes it reads (a few hundred tokens of K and V) take under 1 µs.
//
// Grid (S, Hkv, B): CTA (s, h, b) takes the tokens [s * per, min(L, (s + 1) * per)) of request b (L = seq_lens[b],
// per = ceil(L / S)) for the G = Hq / Hkv query heads of KV head h. Its 4 warps take every 4th token; lane l holds
// dims 4 l .. 4 l + 3 of q, of each token's K and V (8-byte loads: a warp reads a token's 256 bytes of K and of V
// contiguously) and of its running sums; a dot product is a warp reduction. Online softmax per (warp, head): max
// m, sum l, unnormalized output o. The warps combine in shared memory; with S = 1 the CTA writes out, else it writes
// its (m, l, o) to the workspace and the last CTA of (b, h) to arrive (a counter, reset by it) combines the S
// partials in split order (deterministic) and writes out. One launch a layer; L is read on the device, so a CUDA
// graph replays it at any length.
#pragma once

#include <cuda_bf16.h>

namespace twin_attn {

constexpr int kWarps = 4;
constexpr int kD = 128;  // head dim: 32 lanes x 4

struct Params {
  const __nv_bfloat16* q;  // [B, Hq, D] at q_stride elements a token
  const __nv_bfloat16* k;  // [num_blocks, block_size, Hkv, D] at the strides below (vLLM 0.27.1's FlashAttention
  const __nv_bfloat16* v;  // cache is [num_blocks, Hkv, block_size, 2 D] seen so: K and V share the strides)
  const int* block_table;  // [B, bt_stride]
  const int* seq_lens;     // [B]: tokens of each request in the cache, the query's own included
  __nv_bfloat16* out;      // [B, Hq, D] at out_stride elements a token
  float* ws_o;             // [B, Hq, S, D]: unnormalized partial outputs (S > 1)
  float* ws_ml;            // [B, Hq, S, 2]: partial max and sum
  int* counters;           // [B, Hkv], zero between launches
  long long kv_block_stride, kv_token_stride, kv_head_stride;  // elements
  int B, Hq, Hkv, S, block_size, bt_stride, q_stride, out_stride;
  float scale;
};

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000u); }

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

__device__ __forceinline__ void load4(const __nv_bfloat16* p, float (&f)[4]) {
  const uint2 u = *reinterpret_cast<const uint2*>(p);
  const __nv_bfloat162 a = *reinterpret_cast<const __nv_bfloat162*>(&u.x);
  const __nv_bfloat162 b = *reinterpret_cast<const __nv_bfloat162*>(&u.y);
  f[0] = __low2float(a);
  f[1] = __high2float(a);
  f[2] = __low2float(b);
  f[3] = __high2float(b);
}

// m and l of two partials merged into the first (o's rescaled by the caller with the returned factors)
__device__ __forceinline__ void merge_factors(float m1, float m2, float& m, float& f1, float& f2) {
  m = fmaxf(m1, m2);
  f1 = m1 == neg_inf() ? 0.0f : __expf(m1 - m);
  f2 = m2 == neg_inf() ? 0.0f : __expf(m2 - m);
}

template <int G>
__global__ void __launch_bounds__(kWarps * 32) decode_attn(const Params p) {
  const int s = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int L = p.seq_lens[b];
  const int per = (L + p.S - 1) / p.S;
  const int t0 = s * per, t1 = min(L, t0 + per);

  float q[G][4], o[G][4], m[G], l[G];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    load4(p.q + (long long)b * p.q_stride + (long long)(h * G + g) * kD + 4 * lane, q[g]);
    m[g] = neg_inf();
    l[g] = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; ++i) o[g][i] = 0.0f;
  }
  const int* bt = p.block_table + (long long)b * p.bt_stride;
  for (int t = t0 + warp; t < t1; t += kWarps) {
    const long long at = (long long)bt[t / p.block_size] * p.kv_block_stride +
                         (long long)(t % p.block_size) * p.kv_token_stride + (long long)h * p.kv_head_stride + 4 * lane;
    float kf[4], vf[4];
    load4(p.k + at, kf);
    load4(p.v + at, vf);
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const float sc = warp_sum(q[g][0] * kf[0] + q[g][1] * kf[1] + q[g][2] * kf[2] + q[g][3] * kf[3]) * p.scale;
      const float mn = fmaxf(m[g], sc);
      const float c = __expf(m[g] - mn), e = __expf(sc - mn);  // m = -inf at first: c = 0
      l[g] = l[g] * c + e;
#pragma unroll
      for (int i = 0; i < 4; ++i) o[g][i] = o[g][i] * c + e * vf[i];
      m[g] = mn;
    }
  }

  // the warps' partials, combined in shared memory
  __shared__ float sm_o[kWarps][G][kD];
  __shared__ float sm_m[kWarps][G], sm_l[kWarps][G];
#pragma unroll
  for (int g = 0; g < G; ++g) {
#pragma unroll
    for (int i = 0; i < 4; ++i) sm_o[warp][g][4 * lane + i] = o[g][i];
    if (lane == 0) {
      sm_m[warp][g] = m[g];
      sm_l[warp][g] = l[g];
    }
  }
  __syncthreads();
  const long long head0 = (long long)b * p.Hq + h * G;  // the CTA's first query head, as a row of [B * Hq]
  for (int e = threadIdx.x; e < G * kD; e += kWarps * 32) {
    const int g = e / kD, d = e % kD;
    float mc = neg_inf(), lc = 0.0f, oc = 0.0f;
    for (int w = 0; w < kWarps; ++w) {
      float mn, f1, f2;
      merge_factors(mc, sm_m[w][g], mn, f1, f2);
      lc = lc * f1 + sm_l[w][g] * f2;
      oc = oc * f1 + sm_o[w][g][d] * f2;
      mc = mn;
    }
    if (p.S == 1) {
      p.out[(long long)b * p.out_stride + (long long)(h * G + g) * kD + d] =
          __float2bfloat16_rn(lc > 0.0f ? oc / lc : 0.0f);
    } else {
      p.ws_o[((head0 + g) * p.S + s) * kD + d] = oc;
      if (d == 0) {
        p.ws_ml[((head0 + g) * p.S + s) * 2] = mc;
        p.ws_ml[((head0 + g) * p.S + s) * 2 + 1] = lc;
      }
    }
  }
  if (p.S == 1) return;

  // the last CTA of (b, h) combines the S partials in split order
  __shared__ int last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    int* cnt = p.counters + (long long)b * p.Hkv + h;
    last = atomicAdd(cnt, 1) == p.S - 1;
    if (last) *cnt = 0;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  for (int e = threadIdx.x; e < G * kD; e += kWarps * 32) {
    const int g = e / kD, d = e % kD;
    float mc = neg_inf(), lc = 0.0f, oc = 0.0f;
    for (int sp = 0; sp < p.S; ++sp) {
      const long long r = (head0 + g) * p.S + sp;
      float mn, f1, f2;
      merge_factors(mc, __ldcg(p.ws_ml + 2 * r), mn, f1, f2);
      lc = lc * f1 + __ldcg(p.ws_ml + 2 * r + 1) * f2;
      oc = oc * f1 + __ldcg(p.ws_o + r * kD + d) * f2;
      mc = mn;
    }
    p.out[(long long)b * p.out_stride + (long long)(h * G + g) * kD + d] =
        __float2bfloat16_rn(lc > 0.0f ? oc / lc : 0.0f);
  }
}

#define TWIN_ATTN_INSTANTIATE_KERNEL(G) template __global__ void decode_attn<G>(const Params);

}  // namespace twin_attn
