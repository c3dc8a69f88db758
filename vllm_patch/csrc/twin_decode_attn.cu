// torch binding of the draft's decode attention (twin_decode_attn.cuh): checks, parameters, the launch.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include "twin_decode_attn.cuh"

namespace {

template <int G>
void launch(const twin_attn::Params& p, cudaStream_t stream) {
  const dim3 grid(p.S, p.Hkv, p.B);
  if (p.B <= twin_attn::kWideMaxBatch)
    twin_attn::decode_attn<G, twin_attn::kWideWarps><<<grid, twin_attn::kWideWarps * 32, 0, stream>>>(p);
  else
    twin_attn::decode_attn<G, twin_attn::kNarrowWarps><<<grid, twin_attn::kNarrowWarps * 32, 0, stream>>>(p);
}

void decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                      const torch::Tensor& block_table, const torch::Tensor& seq_lens, torch::Tensor& out,
                      torch::Tensor& ws_o, torch::Tensor& ws_ml, torch::Tensor& counters, double scale,
                      int64_t splits) {
  using twin_attn::kD;
  TORCH_CHECK(q.is_cuda() && q.scalar_type() == at::kBFloat16 && q.dim() == 3 && q.size(2) == kD &&
                  q.stride(2) == 1 && q.stride(1) == kD && q.stride(0) % 4 == 0,
              "q: bf16 [B, Hq, 128], heads contiguous");
  TORCH_CHECK(out.scalar_type() == at::kBFloat16 && out.sizes() == q.sizes() && out.stride(2) == 1 &&
                  out.stride(1) == kD,
              "out: bf16 like q");
  TORCH_CHECK(k_cache.scalar_type() == at::kBFloat16 && k_cache.dim() == 4 && k_cache.size(3) == kD &&
                  k_cache.stride(3) == 1 && k_cache.stride(0) % 4 == 0 && k_cache.stride(1) % 4 == 0 &&
                  k_cache.stride(2) % 4 == 0,
              "k_cache: bf16 [num_blocks, block_size, Hkv, 128], dims contiguous, strides multiples of 4");
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes() && v_cache.strides() == k_cache.strides() &&
                  v_cache.scalar_type() == at::kBFloat16,
              "v_cache: like k_cache");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.dim() == 2 && block_table.stride(1) == 1,
              "block_table: int32 [B, max_blocks]");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.dim() == 1 && seq_lens.is_contiguous(),
              "seq_lens: int32 [B]");
  const int64_t b = q.size(0), hq = q.size(1), hkv = k_cache.size(2);
  TORCH_CHECK(block_table.size(0) >= b && seq_lens.size(0) >= b, "block_table and seq_lens cover the batch");
  TORCH_CHECK(hq % hkv == 0, "query heads a multiple of the KV heads");
  const int64_t g = hq / hkv;
  TORCH_CHECK(splits >= 1 && splits <= twin_attn::kMaxSplits, "splits: 1 to ", twin_attn::kMaxSplits);
  if (splits > 1) {
    TORCH_CHECK(ws_o.scalar_type() == at::kFloat && ws_o.numel() >= b * hq * splits * kD, "ws_o");
    TORCH_CHECK(ws_ml.scalar_type() == at::kFloat && ws_ml.numel() >= b * hq * splits * 2, "ws_ml");
    TORCH_CHECK(counters.scalar_type() == at::kInt && counters.numel() >= b * hkv, "counters");
  }
  if (b == 0) return;
  twin_attn::Params p{};
  p.q = reinterpret_cast<const __nv_bfloat16*>(q.data_ptr());
  p.k = reinterpret_cast<const __nv_bfloat16*>(k_cache.data_ptr());
  p.v = reinterpret_cast<const __nv_bfloat16*>(v_cache.data_ptr());
  p.block_table = block_table.data_ptr<int>();
  p.seq_lens = seq_lens.data_ptr<int>();
  p.out = reinterpret_cast<__nv_bfloat16*>(out.data_ptr());
  p.ws_o = splits > 1 ? ws_o.data_ptr<float>() : nullptr;
  p.ws_ml = splits > 1 ? ws_ml.data_ptr<float>() : nullptr;
  p.counters = splits > 1 ? counters.data_ptr<int>() : nullptr;
  p.kv_block_stride = k_cache.stride(0);
  p.kv_token_stride = k_cache.stride(1);
  p.kv_head_stride = k_cache.stride(2);
  p.B = static_cast<int>(b);
  p.Hq = static_cast<int>(hq);
  p.Hkv = static_cast<int>(hkv);
  p.S = static_cast<int>(splits);
  p.block_size = static_cast<int>(k_cache.size(1));
  p.bt_stride = static_cast<int>(block_table.stride(0));
  p.q_stride = static_cast<int>(q.stride(0));
  p.out_stride = static_cast<int>(out.stride(0));
  p.scale = static_cast<float>(scale);
  const c10::cuda::CUDAGuard guard(q.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  switch (g) {
    case 1: launch<1>(p, stream); break;
    case 2: launch<2>(p, stream); break;
    case 4: launch<4>(p, stream); break;
    case 8: launch<8>(p, stream); break;
    default: TORCH_CHECK(false, "query heads per KV head: 1, 2, 4 or 8, not ", g);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "the draft's single-token decode attention over a paged KV cache");
}
