// The CUDA Adam kernel's own source (cuda_adam_kernel.cuh), compiled by g++
// and run over CPU tensors: every block, then every thread of it, in turn.
// The kernel uses no shared memory and no synchronisation, so running its
// threads one after another is exactly what the GPU computes (up to FMA
// contraction). Tests use it to check the kernel on machines without a GPU.
//
// On a GPU machine this module and the real op load into one process. Every
// name here lives in its own namespace and the build hides its symbols
// (cuda_adam.emulated), so no inline function or template of the shared
// kernel header can bind to the other module's copy.
#define zf_cuda zf_cuda_emulated

#include <cmath>

#include "adam/cuda_adam_binding.h"

namespace zf_cuda {
struct ThreadIndex {
  unsigned x;
};
thread_local ThreadIndex blockIdx, threadIdx;
inline float __fsqrt_rn(float x) { return std::sqrt(x); }
}  // namespace zf_cuda

#define __global__
#define __launch_bounds__(n)
#include "adam/cuda_adam_kernel.cuh"

namespace zf_cuda {

void adam_update_emulated(const std::vector<at::Tensor>& params,
                          const std::vector<at::Tensor>& grads,
                          const std::vector<at::Tensor>& exp_avgs,
                          const std::vector<at::Tensor>& exp_avg_sqs,
                          const std::vector<at::Tensor>& lowp, int64_t step, double lr,
                          double beta1, double beta2, double eps, double weight_decay,
                          bool decoupled, double grad_scale) {
  if (params.empty()) return;
  TORCH_CHECK(params[0].is_cpu(), "cuda_adam emulation: params must be CPU tensors");
  auto launch = [](const Key& key, const std::vector<TensorMeta>& metas,
                   const std::vector<BlockMeta>& blocks, const Hyper& h) {
    with_types(key, [&](auto P, auto G, auto L) {
      for (unsigned b = 0; b < blocks.size(); ++b) {
        blockIdx.x = b;
        for (unsigned t = 0; t < unsigned(kThreads); ++t) {
          threadIdx.x = t;
          adam_kernel<decltype(P), decltype(G), decltype(L)>(metas.data(), blocks.data(), h);
        }
      }
    });
  };
  adam_update_groups(params, grads, exp_avgs, exp_avg_sqs, lowp, step, lr, beta1, beta2, eps,
                     weight_decay, decoupled, grad_scale, launch);
}

}  // namespace zf_cuda

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "zfunc's CUDA Adam kernel run on the CPU, thread by thread (for tests)";
  zf_cuda::def_adam_update(m, &zf_cuda::adam_update_emulated,
                           "cuda_adam.adam_update over CPU tensors, by emulating the kernel's grid");
}
