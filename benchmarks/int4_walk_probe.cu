// Memory-access probe for the own W4A16 decode kernel (vllm_patch/csrc/twin_w4a16.cuh): its weight layout's
// read pattern alone, then with the kernel's work per chunk added piece by piece. Which limits the kernel: how
// it walks the weights (tile-major streams per warp, a ring of 16-byte loads in registers) or what it does
// with them (dequantization, the MMAs, x)? No torch, no vLLM; on the GPU host:
//
//   nvcc -O3 -std=c++17 -arch=sm_90a -o int4_walk_probe benchmarks/int4_walk_probe.cu && ./int4_walk_probe
//
// Prints µs (best of 7 timings of 10 back-to-back launches, plain launches, 8 copies of the weights rotated so
// L2 never holds one) and TB/s for the 32B gate_up, down and qkv shapes. Results: results/int4-probe/.
#include <cstdio>
#include <cstdint>
#include <cuda_runtime.h>

#include "../vllm_patch/csrc/twin_w4a16.cuh"  // the kernel's own load, dequantization and MMA helpers

using twin_w4::bf16_pair;
using twin_w4::ld_stream;
using twin_w4::ld_x;
using twin_w4::mma_bf16;
#define CK(x) do { cudaError_t e = (x); if (e) { printf("%s: %s\n", #x, cudaGetErrorString(e)); return 1; } } while (0)

// MODE 2: + the kernel's math per chunk and tile (4 steps: lop3 dequant, the A_z MMA and the A MMA, one chain)
// MODE 3: without the A_z MMA; MODE 4: without it, two accumulator chains; MODE 5: MODE 2 with x loaded from
// global memory one chunk ahead (as the kernel did before it staged x); MODE 6: MODE 4 with x one chunk ahead
template <int R, int RD, int MODE>
__global__ void __launch_bounds__(128, 2) work(const uint4* w, const uint4* x, int T, int C, int cps, unsigned* out) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, t4 = lane & 3;
  const int tile0 = (blockIdx.x * 4 + warp) * R;
  const int c0 = blockIdx.y * cps, n = min(cps, C - c0);
  float P[R][2][4] = {};
  if (tile0 < T) {
    auto at = [&](int r, int c) { return w + ((size_t)min(tile0 + r, T - 1) * C + c0 + c) * 32 + lane; };
    uint4 buf[RD][R];
#pragma unroll
    for (int d = 0; d < RD; ++d)
#pragma unroll
      for (int r = 0; r < R; ++r) buf[d][r] = d < n ? ld_stream(at(r, d)) : make_uint4(0, 0, 0, 0);
    uint4 xa = make_uint4(0x3f803f80u, 0x3f803f80u, 0x3f803f80u, 0x3f803f80u), xb = xa, xn0 = xa, xn1 = xa;
    const uint4* xp = x + (c0 * 8) + t4;
    for (int c = 0; c < n; c += RD) {
#pragma unroll
      for (int d = 0; d < RD; ++d) {
        if (MODE >= 5) { xa = xn0; xb = xn1; xn0 = ld_x(xp + 8 * min(c + d + 1, n - 1)); xn1 = ld_x(xp + 8 * min(c + d + 1, n - 1) + 4); }
#pragma unroll
        for (int r = 0; r < R; ++r) {
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const uint32_t v = i == 0 ? buf[d][r].x : i == 1 ? buf[d][r].y : i == 2 ? buf[d][r].z : buf[d][r].w;
            const uint32_t b0 = (i & 1) ? (i < 2 ? xa.z : xb.z) : (i < 2 ? xa.x : xb.x);
            const uint32_t b1 = (i & 1) ? (i < 2 ? xa.w : xb.w) : (i < 2 ? xa.y : xb.y);
            const int k = (MODE == 4 || MODE == 6) ? (i & 1) : 0;
            if (MODE == 2 || MODE == 5) mma_bf16(P[r][0], 0xC300C300u, 0xC300C300u, 0xC300C300u, 0xC300C300u, b0, b1);
            mma_bf16(P[r][k], bf16_pair(v), bf16_pair(v >> 4), bf16_pair(v >> 8), bf16_pair(v >> 12), b0, b1);
          }
          if (c + d + RD < n) buf[d][r] = ld_stream(at(r, c + d + RD));
        }
      }
    }
  }
  float s = 0;
#pragma unroll
  for (int r = 0; r < R; ++r) s += P[r][0][0] + P[r][1][1];
  if (s == 1234.5f) out[0] = 1;
}

// MODE 0: tile-major [T][C][512 B] (the twin layout): warp streams its R tiles along its chunks
// MODE 1: chunk-major [C][T][512 B]: the same work, adjacent tiles adjacent in memory
template <int R, int RD, int MODE>
__global__ void __launch_bounds__(128) walk(const uint4* w, int T, int C, int cps, unsigned* out) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int tile0 = (blockIdx.x * 4 + warp) * R;
  const int c0 = blockIdx.y * cps, n = min(cps, C - c0);
  unsigned acc = 0;
  if (tile0 < T) {
    auto at = [&](int r, int c) {
      const int t = min(tile0 + r, T - 1);
      return MODE == 0 ? w + ((size_t)t * C + c0 + c) * 32 + lane : w + ((size_t)(c0 + c) * T + t) * 32 + lane;
    };
    uint4 buf[RD][R];
#pragma unroll
    for (int d = 0; d < RD; ++d)
#pragma unroll
      for (int r = 0; r < R; ++r) buf[d][r] = d < n ? ld_stream(at(r, d)) : make_uint4(0, 0, 0, 0);
    for (int c = 0; c < n; c += RD) {
#pragma unroll
      for (int d = 0; d < RD; ++d) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
          acc ^= buf[d][r].x ^ buf[d][r].y ^ buf[d][r].z ^ buf[d][r].w;
          if (c + d + RD < n) buf[d][r] = ld_stream(at(r, c + d + RD));
        }
      }
    }
  }
  if (acc == 0x12345678u) out[0] = acc;
}

__global__ void linear(const uint4* w, size_t n16, unsigned* out) {
  unsigned acc = 0;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n16; i += (size_t)gridDim.x * blockDim.x) {
    uint4 v = ld_stream(w + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x12345678u) out[0] = acc;
}

template <typename F>
float timeit(F f, cudaStream_t s) {
  cudaEvent_t a, b;
  cudaEventCreate(&a); cudaEventCreate(&b);
  for (int i = 0; i < 3; ++i) f();
  float best = 1e9;
  for (int rep = 0; rep < 7; ++rep) {
    cudaEventRecord(a, s);
    for (int i = 0; i < 10; ++i) f();
    cudaEventRecord(b, s);
    cudaEventSynchronize(b);
    float ms; cudaEventElapsedTime(&ms, a, b);
    best = ms / 10 < best ? ms / 10 : best;
  }
  return best * 1000.f;  // µs
}

int main() {
  // 32B gate_up and down at int4: N x K / 2 bytes; the buffer repeats over 8 copies so L2 (50 MB) never holds one
  struct G { const char* name; int N, K; } gs[] = {{"gate_up", 51200, 5120}, {"down", 5120, 25600}, {"qkv", 10240, 5120}};
  int sms; cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  unsigned* out; CK(cudaMalloc(&out, 4));
  for (auto& g : gs) {
    const int T = g.N / 16, C = g.K / 64;
    const size_t bytes = (size_t)T * C * 512;
    const int copies = 8;
    uint4* buf; CK(cudaMalloc(&buf, bytes * copies));
    cudaMemset(buf, 1, bytes * copies);
    int k = 0;
    auto cur = [&]() { k = (k + 1) % copies; return buf + (bytes / 16) * k; };
    float lin = timeit([&] { linear<<<sms * 8, 256>>>(cur(), bytes / 16, out); }, 0);
    printf("%s %.1f MB: linear %.1f us %.2f TB/s\n", g.name, bytes / 1e6, lin, bytes / lin / 1e6);
    // 1. the layout: the twin's tile-major order against chunk-major (adjacent tiles adjacent), loads only
    for (int R : {1, 2, 4}) for (int waves : {3, 6, 12}) {
      const int rb = (T + 4 * R - 1) / (4 * R);
      int want = waves * sms / rb; if (want < 1) want = 1;
      int cps = (C + want - 1) / want; cps = (cps + 3) / 4 * 4; if (cps > C) cps = C;
      const int S = (C + cps - 1) / cps;
      dim3 grid(rb, S);
      for (int mode = 0; mode < 2; ++mode) {
        float us;
        if (R == 1) us = timeit([&] { mode ? walk<1, 8, 1><<<grid, 128>>>(cur(), T, C, cps, out) : walk<1, 8, 0><<<grid, 128>>>(cur(), T, C, cps, out); }, 0);
        else if (R == 2) us = timeit([&] { mode ? walk<2, 4, 1><<<grid, 128>>>(cur(), T, C, cps, out) : walk<2, 4, 0><<<grid, 128>>>(cur(), T, C, cps, out); }, 0);
        else us = timeit([&] { mode ? walk<4, 4, 1><<<grid, 128>>>(cur(), T, C, cps, out) : walk<4, 4, 0><<<grid, 128>>>(cur(), T, C, cps, out); }, 0);
        printf("%s r%d w%d grid %dx%d %s: %.1f us %.2f TB/s\n", g.name, R, waves, rb, S, mode ? "chunk-major" : "tile-major ", us, bytes / us / 1e6);
      }
    }
    // 2. the kernel's work per chunk added to the tile-major walk (modes: see work<>)
    uint4* xbuf; CK(cudaMalloc(&xbuf, (size_t)g.K * 2 + 4096)); cudaMemset(xbuf, 0, (size_t)g.K * 2 + 4096);
    for (int R : {2, 4}) for (int waves : {3, 6}) {
      const int rb = (T + 4 * R - 1) / (4 * R);
      int want = waves * sms / rb; if (want < 1) want = 1;
      int cps = (C + want - 1) / want; cps = (cps + 3) / 4 * 4; if (cps > C) cps = C;
      const int S = (C + cps - 1) / cps;
      dim3 grid(rb, S);
      for (int mode = 0; mode <= 6; ++mode) {
        if (mode == 1) continue;
        float us = 0;
#define RUN(RR, MM) us = timeit([&] { MM == 0 ? walk<RR, 4, 0><<<grid, 128>>>(cur(), T, C, cps, out) : work<RR, 4, MM><<<grid, 128>>>(cur(), xbuf, T, C, cps, out); }, 0)
        if (R == 2) { switch (mode) { case 0: RUN(2, 0); break; case 2: RUN(2, 2); break; case 3: RUN(2, 3); break; case 4: RUN(2, 4); break; case 5: RUN(2, 5); break; case 6: RUN(2, 6); break; } }
        else { switch (mode) { case 0: RUN(4, 0); break; case 2: RUN(4, 2); break; case 3: RUN(4, 3); break; case 4: RUN(4, 4); break; case 5: RUN(4, 5); break; case 6: RUN(4, 6); break; } }
        printf("%s r%d w%d grid %dx%d mode %d: %.1f us %.2f TB/s\n", g.name, R, waves, rb, S, mode, us, bytes / us / 1e6);
      }
    }
    cudaFree(xbuf);
    CK(cudaGetLastError());
    cudaFree(buf);
  }
  return 0;
}
