// The twin's layout (twin_w4a16.cuh) dequantized to bf16 rows, for the large-M path (a prefill, a wide first
// pass): there the decode kernel would read every weight once per 16 tokens, so twin_cuda.w4a16_mm instead
// dequantizes slices of row tiles into a bf16 [rows, K] buffer and multiplies x with it on cuBLAS.
//
// w[16 (tile - tile0) + row][k] = bf16((q - z) s): (q - z) is an integer in [-15, 15] and s a bf16, so the
// product is exact in fp32 and rounded once, to nearest even (what twin_cuda_layout.kernel_weight gives,
// rounded to bf16). One thread a 16-byte word of the layout (tile, chunk, lane): rows g and g + 8 of its
// two 32-k sub-blocks, 8 consecutive k each, stored as 16-byte words.
#pragma once

#include "twin_w4a16.cuh"

namespace twin_w4 {

constexpr int kDequantThreads = 256;

__device__ __forceinline__ uint32_t bf16x2_of(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

__global__ void __launch_bounds__(kDequantThreads) w4a16_dequant(const DequantParams p) {
  const long long idx = (long long)blockIdx.x * kDequantThreads + threadIdx.x;
  if (idx >= (long long)p.tiles * p.C * 32) return;
  const int lane = static_cast<int>(idx & 31), g = lane >> 2, t = lane & 3;
  const long long tc = idx >> 5;
  const int c = static_cast<int>(tc % p.C), tl = static_cast<int>(tc / p.C), tile = p.tile0 + tl;
  const uint4 v = ld_stream(static_cast<const uint4*>(p.qw) + ((size_t)tile * p.C + c) * 32 + lane);
  const int row_g = 16 * tl + g;  // local rows g and g + 8 of the tile
  const bool in_lo = 16 * tile + g < p.N, in_hi = 16 * tile + g + 8 < p.N;
  __nv_bfloat16* w = static_cast<__nv_bfloat16*>(p.w);
  // sub-block sb: words 2 sb (k0 .. k0 + 3) and 2 sb + 1 (k0 + 4 .. k0 + 7) of rows g and g + 8, k0 = 64 c + 32 sb
  // + 8 t: 8 consecutive k of a row, one 16-byte store (a warp writes 64 contiguous bytes of each of 8 rows)
#pragma unroll
  for (int sb = 0; sb < 2; ++sb) {
    const int k0 = 64 * c + 32 * sb + 8 * t;
    const size_t at = ((size_t)tile * p.NG + k0 / p.group) * 8 + g;  // a group holds whole 32-k sub-blocks
    const uint32_t sw = __ldg(static_cast<const uint32_t*>(p.sc) + at);
    const float s_lo = __uint_as_float(sw << 16), s_hi = __uint_as_float(sw & 0xFFFF0000u);
    float z_lo = 8.0f, z_hi = 8.0f;
    if (p.zp != nullptr) {
      const uint32_t zb = __ldg(static_cast<const uint8_t*>(p.zp) + at);
      z_lo = static_cast<float>(zb & 15u);
      z_hi = static_cast<float>(zb >> 4);
    }
    uint4 lo, hi;
    uint32_t* lw = &lo.x;
    uint32_t* hw = &hi.x;
#pragma unroll
    for (int ii = 0; ii < 2; ++ii) {
      const uint32_t wd = word(v, 2 * sb + ii);
      // nibble j = p + 4 h: row g + 8 (p & 1), k0 + 4 ii + 2 (p >> 1) + h
      auto q = [&](int pp, int h) { return static_cast<float>((wd >> (4 * (pp + 4 * h))) & 15u); };
      lw[2 * ii] = bf16x2_of((q(0, 0) - z_lo) * s_lo, (q(0, 1) - z_lo) * s_lo);
      lw[2 * ii + 1] = bf16x2_of((q(2, 0) - z_lo) * s_lo, (q(2, 1) - z_lo) * s_lo);
      hw[2 * ii] = bf16x2_of((q(1, 0) - z_hi) * s_hi, (q(1, 1) - z_hi) * s_hi);
      hw[2 * ii + 1] = bf16x2_of((q(3, 0) - z_hi) * s_hi, (q(3, 1) - z_hi) * s_hi);
    }
    if (in_lo) *reinterpret_cast<uint4*>(w + (size_t)row_g * p.ldw + k0) = lo;
    if (in_hi) *reinterpret_cast<uint4*>(w + (size_t)(row_g + 8) * p.ldw + k0) = hi;
  }
}

// y [M][ldy] <- silu(gate) * up of a gate_up output h [M][ldh], as the decode kernel's epilogue computes it; one
// thread 8 outputs. A paired layout (halves 0; twin_cuda_layout.pair_tiles): gate rows 32 i + j, up 32 i + 16 + j
// -> row 16 i + j. Halves (halves 1; vLLM's merged gate_up, as Marlin's GEMM writes it): gate j, up half + j -> j.
__global__ void __launch_bounds__(kDequantThreads) w4a16_silu_mul_pairs(const void* hp, void* yp, int m, int half,
                                                                        int ldh, int ldy, int halves) {
  const long long idx = (long long)blockIdx.x * kDequantThreads + threadIdx.x;
  const int per_row = half / 8;
  if (idx >= (long long)m * per_row) return;
  const int tok = static_cast<int>(idx / per_row), out = static_cast<int>(idx % per_row) * 8;
  const int gate = halves ? out : 32 * (out / 16) + out % 16, up = halves ? half + out : gate + 16;
  const __nv_bfloat16* h = static_cast<const __nv_bfloat16*>(hp) + (size_t)tok * ldh;
  const uint4 gv = *reinterpret_cast<const uint4*>(h + gate), uv = *reinterpret_cast<const uint4*>(h + up);
  const __nv_bfloat16* g8 = reinterpret_cast<const __nv_bfloat16*>(&gv);
  const __nv_bfloat16* u8 = reinterpret_cast<const __nv_bfloat16*>(&uv);
  uint4 o;
  __nv_bfloat16* o8 = reinterpret_cast<__nv_bfloat16*>(&o);
#pragma unroll
  for (int e = 0; e < 8; ++e) o8[e] = silu_mul(__bfloat162float(g8[e]), __bfloat162float(u8[e]));
  *reinterpret_cast<uint4*>(static_cast<__nv_bfloat16*>(yp) + (size_t)tok * ldy + out) = o;
}


}  // namespace twin_w4
