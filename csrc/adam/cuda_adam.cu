// Multi-tensor fused Adam/AdamW for CUDA tensors: one launch per dtype
// combination covers every tensor of the call (kernel and host logic in
// cuda_adam_kernel.cuh).
//
// The host packs, for each tensor, its pointers and length (TensorMeta) and,
// for each block, which tensor and which chunk of it the block updates
// (BlockMeta); both arrays go to the device in one copy on the current
// stream, ahead of the kernel on the same stream.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstring>

#include "adam/cuda_adam_kernel.cuh"

namespace zf_cuda {

void adam_update(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                 const std::vector<at::Tensor>& exp_avgs,
                 const std::vector<at::Tensor>& exp_avg_sqs,
                 const std::vector<at::Tensor>& lowp, int64_t step, double lr, double beta1,
                 double beta2, double eps, double weight_decay, bool decoupled,
                 double grad_scale) {
  if (params.empty()) return;
  TORCH_CHECK(params[0].is_cuda(), "cuda_adam: params must be CUDA tensors");
  const at::Device device = params[0].device();
  c10::cuda::CUDAGuard guard(device);
  auto launch = [&](const Key& key, const std::vector<TensorMeta>& metas,
                    const std::vector<BlockMeta>& blocks, const Hyper& h) {
    // One host buffer, one copy to the device (ordered on the current stream).
    const size_t tbytes = metas.size() * sizeof(TensorMeta);
    const size_t bbytes = blocks.size() * sizeof(BlockMeta);
    at::Tensor host = at::empty({int64_t(tbytes + bbytes)}, at::TensorOptions().dtype(at::kByte));
    std::memcpy(host.data_ptr(), metas.data(), tbytes);
    std::memcpy(static_cast<char*>(host.data_ptr()) + tbytes, blocks.data(), bbytes);
    at::Tensor dev = host.to(device);
    const auto* dmeta = reinterpret_cast<const TensorMeta*>(dev.data_ptr());
    const auto* dblocks =
        reinterpret_cast<const BlockMeta*>(static_cast<const char*>(dev.data_ptr()) + tbytes);
    cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    with_types(key, [&](auto P, auto G, auto L) {
      adam_kernel<decltype(P), decltype(G), decltype(L)>
          <<<unsigned(blocks.size()), kThreads, 0, stream>>>(dmeta, dblocks, h);
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  adam_update_groups(params, grads, exp_avgs, exp_avg_sqs, lowp, step, lr, beta1, beta2, eps,
                     weight_decay, decoupled, grad_scale, launch);
}

}  // namespace zf_cuda
