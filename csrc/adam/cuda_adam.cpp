// Python bindings of the multi-tensor CUDA Adam (kernels in cuda_adam.cu).
#include "adam/cuda_adam_binding.h"

namespace zf_cuda {
AdamUpdate adam_update;  // defined in cuda_adam.cu
}  // namespace zf_cuda

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "zfunc multi-tensor CUDA Adam";
  zf_cuda::def_adam_update(
      m, &zf_cuda::adam_update,
      "Fused Adam/AdamW over lists of CUDA tensors (one launch per dtype combination)");
}
