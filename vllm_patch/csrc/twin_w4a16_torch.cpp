// torch binding of the W4A16 decode kernel: checks, parameters, and the dispatch to one instance.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include "twin_w4a16_api.h"

namespace {

void w4a16_mm(const torch::Tensor& x, const torch::Tensor& qw, const torch::Tensor& sc,
              const c10::optional<torch::Tensor>& zp, torch::Tensor& y, torch::Tensor& ws, torch::Tensor& counters,
              int64_t n, int64_t group, int64_t r, int64_t nt, int64_t cps, bool deep, bool pipe, bool pdl,
              bool bulk, bool act) {
  TORCH_CHECK(x.is_cuda() && x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.stride(1) == 1, "x: bf16 [M, K]");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0 && x.stride(0) % 8 == 0, "x rows 16-byte aligned");
  TORCH_CHECK(qw.scalar_type() == at::kInt && qw.dim() == 4 && qw.is_contiguous(), "qw: int32 [T, C, 32, 4]");
  TORCH_CHECK(sc.scalar_type() == at::kInt && sc.dim() == 3 && sc.is_contiguous(), "sc: int32 [T, G, 8]");
  TORCH_CHECK(y.scalar_type() == at::kBFloat16 && y.dim() == 2 && y.stride(1) == 1, "y: bf16 [M, N]");
  const int64_t m = x.size(0), k = x.size(1), t = qw.size(0), c = qw.size(1);
  TORCH_CHECK(k == 64 * c && t == (n + 15) / 16 && y.size(0) == m && y.size(1) == (act ? n / 2 : n), "shapes");
  TORCH_CHECK(!act || (n % 32 == 0 && r % 2 == 0),
              "the silu(gate) * up epilogue takes paired row tiles (N a multiple of 32) and r 2 or 4, not n=", n,
              " r=", r);
  TORCH_CHECK(group == 32 || group == 64 || group == 128, "group 32, 64 or 128");
  TORCH_CHECK(sc.size(0) == t && sc.size(1) == k / group, "scales [T, K / group, 8]");
  const bool has_z = zp.has_value();
  if (has_z) TORCH_CHECK(zp->scalar_type() == at::kByte && zp->sizes() == sc.sizes() && zp->is_contiguous(), "zp");
  TORCH_CHECK(r == 1 || r == 2 || r == 4, "r in 1, 2, 4");
  TORCH_CHECK(!pipe || (r <= 2 && !deep), "the staged kernel (pipe): r in 1, 2, no deep scale ring");
  TORCH_CHECK(!pipe || !pdl, "the staged kernel (pipe) is not launched as a programmatic dependent");
  TORCH_CHECK(!bulk || (!pipe && !deep), "the TMA-fed kernel (bulk): no deep scale ring, no staging");
  TORCH_CHECK(nt == 1 || nt == 2, "nt in 1, 2");
  TORCH_CHECK(nt == 2 || std::min<int64_t>(x.size(0), 8) * (cps * 8 + 1) * 16 <= twin_w4::kXStageBytes,
              "the CTA's x rows over ", cps, " chunks exceed ", twin_w4::kXStageBytes,
              " bytes of shared memory; plan more splits (twin_cuda.plan does)");
  if (m == 0) return;
  const int64_t splits = (c + cps - 1) / cps;
  const int64_t row_blocks = (t + twin_w4::kWarps * r - 1) / (twin_w4::kWarps * r);
  const int64_t token_blocks = (m + 8 * nt - 1) / (8 * nt);
  if (splits > 1) {
    TORCH_CHECK(ws.scalar_type() == at::kFloat && ws.numel() >= splits * m * n, "workspace");
    TORCH_CHECK(counters.scalar_type() == at::kInt && counters.numel() >= row_blocks * token_blocks, "counters");
  }
  twin_w4::Params p{};
  p.qw = qw.data_ptr();
  p.sc = sc.data_ptr();
  p.zp = has_z ? zp->data_ptr() : nullptr;
  p.x = x.data_ptr();
  p.y = y.data_ptr();
  p.ws = splits > 1 ? ws.data_ptr<float>() : nullptr;
  p.counters = splits > 1 ? counters.data_ptr<int>() : nullptr;
  p.M = static_cast<int>(m);
  p.N = static_cast<int>(n);
  p.T = static_cast<int>(t);
  p.C = static_cast<int>(c);
  p.NG = static_cast<int>(k / group);
  p.cps = static_cast<int>(cps);
  p.S = static_cast<int>(splits);
  p.ldx = static_cast<int>(x.stride(0));
  p.ldy = static_cast<int>(y.stride(0));
  p.pdl = pdl ? 1 : 0;
  p.act = act ? 1 : 0;
  const dim3 grid(static_cast<unsigned>(row_blocks), static_cast<unsigned>(splits),
                  static_cast<unsigned>(token_blocks));
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int gs = static_cast<int>(group / 32);
#define TWIN_W4_DISPATCH(R_, NT_, GS_, HZ_, DP_)                             \
  if (r == R_ && nt == NT_ && gs == GS_ && has_z == HZ_ && deep == DP_) {  \
    twin_w4::launch<R_, NT_, GS_, HZ_, DP_>(p, grid, stream);               \
    C10_CUDA_KERNEL_LAUNCH_CHECK();                                          \
    return;                                                                  \
  }
#define TWIN_W4_DISPATCH_PIPE(R_, NT_, GS_, HZ_)                             \
  if (pipe && r == R_ && nt == NT_ && gs == GS_ && has_z == HZ_) {          \
    twin_w4::launch_pipe<R_, NT_, GS_, HZ_>(p, grid, stream);               \
    C10_CUDA_KERNEL_LAUNCH_CHECK();                                          \
    return;                                                                  \
  }
  TWIN_W4_PIPE_FOR_EACH(TWIN_W4_DISPATCH_PIPE)
#undef TWIN_W4_DISPATCH_PIPE
#define TWIN_W4_DISPATCH_BULK(R_, NT_, GS_, HZ_)                             \
  if (bulk && r == R_ && nt == NT_ && gs == GS_ && has_z == HZ_) {          \
    twin_w4::launch_bulk<R_, NT_, GS_, HZ_>(p, grid, stream);               \
    C10_CUDA_KERNEL_LAUNCH_CHECK();                                          \
    return;                                                                  \
  }
  if (bulk) {
    TORCH_CHECK(r * ((cps * 2 + group / 32 - 1) / (group / 32)) * 48 <= twin_w4::kBulkMetaBytes,
                "the TMA-fed kernel (bulk): a warp's scales and zero points over ", cps,
                " chunks exceed its shared memory; plan more splits (twin_cuda.plan(..., bulk=True) does)");
    int dev = 0, major = 0;
    C10_CUDA_CHECK(cudaGetDevice(&dev));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    TORCH_CHECK(major >= 9, "the TMA-fed kernel (bulk) needs compute capability 9.0 or newer");
  }
  TWIN_W4_BULK_FOR_EACH(TWIN_W4_DISPATCH_BULK)
#undef TWIN_W4_DISPATCH_BULK
  if (!pipe && !bulk) {
    TWIN_W4_FOR_EACH(TWIN_W4_DISPATCH)
  }
#undef TWIN_W4_DISPATCH
  TORCH_CHECK(false, "no kernel instance for r=", r, " nt=", nt, " group=", group);
}

// w[16 tiles, K] bf16 <- row tiles [tile0, tile0 + tiles) of the layout, dequantized (rows past n not written)
void w4a16_dequant(const torch::Tensor& qw, const torch::Tensor& sc, const c10::optional<torch::Tensor>& zp,
                   torch::Tensor& w, int64_t n, int64_t group, int64_t tile0, int64_t tiles) {
  TORCH_CHECK(qw.is_cuda() && qw.scalar_type() == at::kInt && qw.dim() == 4 && qw.is_contiguous(),
              "qw: int32 [T, C, 32, 4]");
  TORCH_CHECK(sc.scalar_type() == at::kInt && sc.dim() == 3 && sc.is_contiguous(), "sc: int32 [T, G, 8]");
  const int64_t t = qw.size(0), c = qw.size(1), k = 64 * c;
  TORCH_CHECK(t == (n + 15) / 16, "qw holds ", t, " row tiles, not those of n = ", n);
  TORCH_CHECK(group == 32 || group == 64 || group == 128, "group 32, 64 or 128");
  TORCH_CHECK(sc.size(0) == t && sc.size(1) == k / group, "scales [T, K / group, 8]");
  if (zp.has_value()) TORCH_CHECK(zp->scalar_type() == at::kByte && zp->sizes() == sc.sizes() && zp->is_contiguous(), "zp");
  TORCH_CHECK(tile0 >= 0 && tiles >= 0 && tile0 + tiles <= t, "tiles [", tile0, ", ", tile0 + tiles, ") of ", t);
  TORCH_CHECK(w.is_cuda() && w.scalar_type() == at::kBFloat16 && w.dim() == 2 && w.stride(1) == 1 &&
                  w.size(1) == k && w.size(0) >= std::min<int64_t>(16 * tiles, n - 16 * tile0) &&
                  w.stride(0) % 8 == 0 && reinterpret_cast<uintptr_t>(w.data_ptr()) % 16 == 0,
              "w: bf16 [rows, K], rows 16-byte aligned, room for the tiles' rows");
  twin_w4::DequantParams p{};
  p.qw = qw.data_ptr();
  p.sc = sc.data_ptr();
  p.zp = zp.has_value() ? zp->data_ptr() : nullptr;
  p.w = w.data_ptr();
  p.N = static_cast<int>(n);
  p.C = static_cast<int>(c);
  p.NG = static_cast<int>(k / group);
  p.group = static_cast<int>(group);
  p.tile0 = static_cast<int>(tile0);
  p.tiles = static_cast<int>(tiles);
  p.ldw = static_cast<int>(w.stride(0));
  const c10::cuda::CUDAGuard guard(qw.device());
  twin_w4::launch_dequant(p, c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// y [M, N / 2] <- silu(gate) * up of h [M, N]: the output of a paired gate_up layout, or (halves) of vLLM's
// merged gate_up, gate columns first (one launch)
void silu_mul(const torch::Tensor& h, torch::Tensor& y, bool halves) {
  TORCH_CHECK(h.is_cuda() && h.scalar_type() == at::kBFloat16 && h.dim() == 2 && h.stride(1) == 1 &&
                  h.size(1) % (halves ? 16 : 32) == 0 && h.stride(0) % 8 == 0 &&
                  reinterpret_cast<uintptr_t>(h.data_ptr()) % 16 == 0,
              halves ? "h: bf16 [M, N], N a multiple of 16, rows 16-byte aligned"
                     : "h: bf16 [M, N], N a multiple of 32, rows 16-byte aligned");
  TORCH_CHECK(y.scalar_type() == at::kBFloat16 && y.dim() == 2 && y.stride(1) == 1 && y.size(0) == h.size(0) &&
                  y.size(1) == h.size(1) / 2 && y.stride(0) % 8 == 0 &&
                  reinterpret_cast<uintptr_t>(y.data_ptr()) % 16 == 0,
              "y: bf16 [M, N / 2], rows 16-byte aligned");
  const c10::cuda::CUDAGuard guard(h.device());
  twin_w4::launch_silu_mul_pairs(h.data_ptr(), y.data_ptr(), static_cast<int>(h.size(0)),
                                 static_cast<int>(y.size(1)), static_cast<int>(h.stride(0)),
                                 static_cast<int>(y.stride(0)), halves ? 1 : 0, c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void w4a16_silu_mul_pairs(const torch::Tensor& h, torch::Tensor& y) { silu_mul(h, y, false); }

void w4a16_silu_mul_halves(const torch::Tensor& h, torch::Tensor& y) { silu_mul(h, y, true); }

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("w4a16_mm", &w4a16_mm, "W4A16 decode GEMM (bf16): y = x @ dequant(W)^T");
  m.def("w4a16_dequant", &w4a16_dequant, "row tiles of the layout dequantized to bf16 rows (the large-M path)");
  m.def("w4a16_silu_mul_pairs", &w4a16_silu_mul_pairs, "silu(gate) * up of a paired gate_up layout's output");
  m.def("w4a16_silu_mul_halves", &w4a16_silu_mul_halves, "silu(gate) * up of a merged gate_up output [gate | up]");
}
