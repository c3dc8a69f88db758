// Host launcher of the dequantization to bf16 rows (twin_w4a16_dequant.cuh): the large-M path.
#include "twin_w4a16_dequant.cuh"

namespace twin_w4 {

void launch_dequant(const DequantParams& p, cudaStream_t stream) {
  const long long threads = (long long)p.tiles * p.C * 32;
  const unsigned blocks = static_cast<unsigned>((threads + kDequantThreads - 1) / kDequantThreads);
  if (blocks > 0) w4a16_dequant<<<blocks, kDequantThreads, 0, stream>>>(p);
}

void launch_silu_mul_pairs(const void* h, void* y, int m, int half, int ldh, int ldy, int halves,
                           cudaStream_t stream) {
  const long long threads = (long long)m * (half / 8);
  const unsigned blocks = static_cast<unsigned>((threads + kDequantThreads - 1) / kDequantThreads);
  if (blocks > 0) w4a16_silu_mul_pairs<<<blocks, kDequantThreads, 0, stream>>>(h, y, m, half, ldh, ldy, halves);
}

}  // namespace twin_w4
