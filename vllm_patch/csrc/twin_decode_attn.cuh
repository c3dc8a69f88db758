// Decode attention for the draft's single-token steps: one query token per request against its paged KV cache
// (vLLM's FlashAttention cache, any strides), grouped-query heads, head dim 128, bf16 in and out, fp32 softmax and sums.
//
// Why: in the draft's single-token step FlashAttention 3 takes two launches a layer (its split-KV kernel and the
// combine), 12 µs a layer at batch 1 on an H100 (8B shape, results/draft-profile/20261206T224809Z-h100-marlin-
// traced): 0.43 ms of a 3.4 ms step, where the bytes it reads (a few hundred tokens of K and V) take under 1 µs.
//
// Grid (S, Hkv, B), S the most splits (fixed per batch size, so one CUDA graph serves any length): request b uses S_b =
// ceil(L / per) of them, per = max(ceil(L / S), kMinSplitTokens) tokens each (L = seq_lens[b], read on the device);
// CTAs past S_b exit at once. CTA (s, h, b) takes the tokens [s * per, min(L, (s + 1) * per)) for the G = Hq / Hkv
// query heads of KV head h. Each of its W warps (8 at batch 1-2, 4 above) takes kUnroll consecutive tokens at a time
// (then the next kUnroll * W), their K and V loaded together, so kUnroll reductions and loads are in flight at once;
// lane l holds dims 4 l .. 4 l + 3 of q, of each token's K and V (8-byte loads: a warp reads a token's 256 bytes of K
// and of V contiguously) and of its running sums; a dot product is a warp reduction. Online softmax per (warp, head):
// max m, sum l, unnormalized output o, updated once per kUnroll tokens. The warps combine in shared memory; with S_b =
// 1 the CTA writes out, else it writes its (m, l, o) to the workspace and the last CTA of (b, h) to arrive (a counter,
// reset by it) combines the S_b partials: the largest m first, then each split's weight exp(m_s - m), then the weighted
// sums in split order (deterministic). One launch a layer.
//
// Measured before these changes (one token a warp at a time, every split used however short, splits merged one by
// one; results/decode-attn/20261207T081653Z-h100): 13.4 µs at batch 1 and 192 tokens (8B shape), 23.0 µs at the
// drafter's 33 splits, 46 µs at 3584 tokens: latency-bound, slower than FlashAttention 3's two launches.
#pragma once

#include <cuda_bf16.h>

namespace twin_attn {

constexpr int kWideWarps = 8;      // warps a CTA at batch <= kWideMaxBatch: more tokens in flight a split
constexpr int kNarrowWarps = 4;    // above: more CTAs an SM, a shorter merge (H100, 8B batch 16: 16.5 against
constexpr int kWideMaxBatch = 2;   // 20.2 µs at 192 tokens with 8; batch 1: 9.0 against 11.0)
constexpr int kD = 128;             // head dim: 32 lanes x 4
constexpr int kUnroll = 4;          // tokens a warp has in flight
constexpr int kMinSplitTokens = 64; // a split takes at least this many tokens: short requests use fewer splits
constexpr int kMaxSplits = 128;     // the combine's weights in shared memory (the binding refuses more)

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

template <int G, int W>
__global__ void __launch_bounds__(W * 32) decode_attn(const Params p) {
  const int s = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int L = p.seq_lens[b];
  const int per = max((L + p.S - 1) / p.S, kMinSplitTokens);
  const int S = max(1, (L + per - 1) / per);  // the splits request b uses (<= p.S)
  if (s >= S) return;
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
  for (int t = t0 + warp * kUnroll; t < t1; t += W * kUnroll) {
    float kf[kUnroll][4], vf[kUnroll][4];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int tu = min(t + u, t1 - 1);  // past the end: the last token again, masked below
      const long long at = (long long)bt[tu / p.block_size] * p.kv_block_stride +
                           (long long)(tu % p.block_size) * p.kv_token_stride + (long long)h * p.kv_head_stride +
                           4 * lane;
      load4(p.k + at, kf[u]);
      load4(p.v + at, vf[u]);
    }
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float sc[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        sc[u] = q[g][0] * kf[u][0] + q[g][1] * kf[u][1] + q[g][2] * kf[u][2] + q[g][3] * kf[u][3];
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) {
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) sc[u] += __shfl_xor_sync(0xffffffffu, sc[u], off);
      }
      float mn = m[g];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        sc[u] = t + u < t1 ? sc[u] * p.scale : neg_inf();
        mn = fmaxf(mn, sc[u]);  // finite: token t is in range
      }
      const float c = __expf(m[g] - mn);  // m = -inf at first: c = 0
      l[g] *= c;
#pragma unroll
      for (int i = 0; i < 4; ++i) o[g][i] *= c;
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const float e = __expf(sc[u] - mn);  // a masked token: 0
        l[g] += e;
#pragma unroll
        for (int i = 0; i < 4; ++i) o[g][i] += e * vf[u][i];
      }
      m[g] = mn;
    }
  }

  // the warps' partials, combined in shared memory
  __shared__ float sm_o[W][G][kD];
  __shared__ float sm_m[W][G], sm_l[W][G];
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
  for (int e = threadIdx.x; e < G * kD; e += W * 32) {
    const int g = e / kD, d = e % kD;
    float mc = neg_inf(), lc = 0.0f, oc = 0.0f;
    for (int w = 0; w < W; ++w) {
      float mn, f1, f2;
      merge_factors(mc, sm_m[w][g], mn, f1, f2);
      lc = lc * f1 + sm_l[w][g] * f2;
      oc = oc * f1 + sm_o[w][g][d] * f2;
      mc = mn;
    }
    if (S == 1) {
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
  if (S == 1) return;

  // the last CTA of (b, h) combines the S partials
  __shared__ int last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    int* cnt = p.counters + (long long)b * p.Hkv + h;
    last = atomicAdd(cnt, 1) == S - 1;
    if (last) *cnt = 0;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  __shared__ float sw[G][kMaxSplits];  // each split's m, then its weight
  __shared__ float sl[G];              // the weighted sum of the splits' l
  for (int i = threadIdx.x; i < G * S; i += W * 32) {
    const int g = i / S, sp = i % S;
    sw[g][sp] = __ldcg(p.ws_ml + 2 * ((head0 + g) * p.S + sp));
  }
  __syncthreads();
  if (threadIdx.x < G) {
    const int g = threadIdx.x;
    float mx = neg_inf();
    for (int sp = 0; sp < S; ++sp) mx = fmaxf(mx, sw[g][sp]);
    float ls = 0.0f;
    for (int sp = 0; sp < S; ++sp) {
      const float w = sw[g][sp] == neg_inf() ? 0.0f : __expf(sw[g][sp] - mx);
      sw[g][sp] = w;
      ls += w * __ldcg(p.ws_ml + 2 * ((head0 + g) * p.S + sp) + 1);
    }
    sl[g] = ls;
  }
  __syncthreads();
  for (int e = threadIdx.x; e < G * kD; e += W * 32) {
    const int g = e / kD, d = e % kD;
    float oc = 0.0f;
    for (int sp = 0; sp < S; ++sp) oc += sw[g][sp] * __ldcg(p.ws_o + ((head0 + g) * p.S + sp) * kD + d);
    p.out[(long long)b * p.out_stride + (long long)(h * G + g) * kD + d] =
        __float2bfloat16_rn(sl[g] > 0.0f ? oc / sl[g] : 0.0f);
  }
}

#define TWIN_ATTN_INSTANTIATE_KERNEL(G, W) template __global__ void decode_attn<G, W>(const Params);

}  // namespace twin_attn
