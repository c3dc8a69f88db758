// Host-side interface of the W4A16 decode kernel (twin_w4a16.cuh): parameters and the launch template.
#pragma once

#ifndef __CUDACC_RTC__
#include <cuda_runtime.h>
#endif

namespace twin_w4 {

struct Params {
  const void* qw;   // [T][C][32][4] int32 (uint4 loads)
  const void* sc;   // [T][NG][8] bf16 pairs
  const void* zp;   // [T][NG][8] uint8, or null (uint4b8)
  const void* x;    // [M][ldx] bf16
  void* y;          // [M][ldy] bf16
  float* ws;        // [S][M][N] fp32 split-K partials (S > 1)
  int* counters;    // arrival counters, one per (row block, token block), left zero
  int M, N, T, C, NG;
  int cps;          // chunks per split (a multiple of the ring and the group's chunks, or all of K)
  int S;            // splits (gridDim.y)
  int ldx, ldy;     // row strides of x and y, elements
  int pdl;          // launched as a programmatic dependent: wait for the kernel before (which writes x)
  int ring;         // the TMA-fed kernel: stages in a warp's ring (set by its launcher)
  int act;          // 1: tile pairs (gate, up) -> y [M][N / 2] = silu(gate) * up (R even, N a multiple of 32)
};

// The dequantization of row tiles [tile0, tile0 + tiles) to bf16 rows (twin_w4a16_dequant.cuh), the large-M path
struct DequantParams {
  const void* qw;  // [T][C][32][4] int32
  const void* sc;  // [T][NG][8] bf16 pairs
  const void* zp;  // [T][NG][8] uint8, or null (uint4b8)
  void* w;         // [16 tiles][ldw] bf16; rows past N are not written
  int N, C, NG, group, tile0, tiles, ldw;
};

#ifndef __CUDACC_RTC__
void launch_dequant(const DequantParams& p, cudaStream_t stream);
// y [m][ldy] (half columns) <- silu(gate) * up of a paired layout's output h [m][ldh] (twin_w4a16_dequant.cuh)
void launch_silu_mul_pairs(const void* h, void* y, int m, int half, int ldh, int ldy, int halves,
                           cudaStream_t stream);
#endif

constexpr int kWarps = 4;  // warps per CTA: each its own R row tiles, all on the CTA's k range

#ifndef __CUDACC_RTC__
template <int R, int NT, int GS, bool HAS_Z, bool DEEP>
void launch(const Params& p, dim3 grid, cudaStream_t stream);
#endif

// Every instance: R in {1, 2, 4} row tiles a warp, NT in {1, 2} token tiles of 8, GS = group / 32, DEEP:
// the scales' ring as deep as the weights' (else one span ahead).
#define TWIN_W4_FOR_EACH_R_NT_D(X, GS, HZ, DP) \
  X(1, 1, GS, HZ, DP) X(2, 1, GS, HZ, DP) X(4, 1, GS, HZ, DP) X(1, 2, GS, HZ, DP) X(2, 2, GS, HZ, DP) X(4, 2, GS, HZ, DP)
#define TWIN_W4_FOR_EACH_R_NT(X, GS, HZ) TWIN_W4_FOR_EACH_R_NT_D(X, GS, HZ, false) TWIN_W4_FOR_EACH_R_NT_D(X, GS, HZ, true)
#define TWIN_W4_FOR_EACH_GS(X, HZ) \
  TWIN_W4_FOR_EACH_R_NT(X, 1, HZ) TWIN_W4_FOR_EACH_R_NT(X, 2, HZ) TWIN_W4_FOR_EACH_R_NT(X, 4, HZ)
#define TWIN_W4_FOR_EACH_GS_D(X, HZ, DP) \
  TWIN_W4_FOR_EACH_R_NT_D(X, 1, HZ, DP) TWIN_W4_FOR_EACH_R_NT_D(X, 2, HZ, DP) TWIN_W4_FOR_EACH_R_NT_D(X, 4, HZ, DP)
#define TWIN_W4_FOR_EACH(X) TWIN_W4_FOR_EACH_GS(X, false) TWIN_W4_FOR_EACH_GS(X, true)

#ifndef __CUDACC_RTC__
// The staged kernel (twin_w4a16_pipe.cuh): R in {1, 2}, NT in {1, 2}, GS, zero points.
template <int R, int NT, int GS, bool HAS_Z>
void launch_pipe(const Params& p, dim3 grid, cudaStream_t stream);
#endif
#define TWIN_W4_PIPE_FOR_EACH_GS(X, GS, HZ) X(1, 1, GS, HZ) X(2, 1, GS, HZ) X(1, 2, GS, HZ) X(2, 2, GS, HZ)
#define TWIN_W4_PIPE_FOR_EACH_HZ(X, HZ) \
  TWIN_W4_PIPE_FOR_EACH_GS(X, 1, HZ) TWIN_W4_PIPE_FOR_EACH_GS(X, 2, HZ) TWIN_W4_PIPE_FOR_EACH_GS(X, 4, HZ)
#define TWIN_W4_PIPE_FOR_EACH(X) TWIN_W4_PIPE_FOR_EACH_HZ(X, false) TWIN_W4_PIPE_FOR_EACH_HZ(X, true)

constexpr int kXStageBytes = 96 * 1024;  // the default kernel: the CTA's staged x rows of its split, at most
constexpr int kBulkMetaBytes = 8 * 1024;  // the TMA-fed kernel: a warp's scales and zero points of its split, at most

#ifndef __CUDACC_RTC__
// The TMA-fed kernel (twin_w4a16_bulk.cuh, SM 9.0+): R in {1, 2, 4}, NT in {1, 2}, GS, zero points.
template <int R, int NT, int GS, bool HAS_Z>
void launch_bulk(const Params& p, dim3 grid, cudaStream_t stream);
#endif
#define TWIN_W4_BULK_FOR_EACH_GS(X, GS, HZ) \
  X(1, 1, GS, HZ) X(2, 1, GS, HZ) X(4, 1, GS, HZ) X(1, 2, GS, HZ) X(2, 2, GS, HZ) X(4, 2, GS, HZ)
#define TWIN_W4_BULK_FOR_EACH_HZ(X, HZ) \
  TWIN_W4_BULK_FOR_EACH_GS(X, 1, HZ) TWIN_W4_BULK_FOR_EACH_GS(X, 2, HZ) TWIN_W4_BULK_FOR_EACH_GS(X, 4, HZ)
#define TWIN_W4_BULK_FOR_EACH(X) TWIN_W4_BULK_FOR_EACH_HZ(X, false) TWIN_W4_BULK_FOR_EACH_HZ(X, true)

}  // namespace twin_w4
