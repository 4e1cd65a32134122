// Python bindings of the multi-tensor CUDA Adam (kernels in cuda_adam.cu).
#include <torch/csrc/utils/pybind.h>

#include <vector>

namespace zf_cuda {
void adam_update(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                 const std::vector<at::Tensor>& exp_avgs,
                 const std::vector<at::Tensor>& exp_avg_sqs,
                 const std::vector<at::Tensor>& lowp, int64_t step, double lr, double beta1,
                 double beta2, double eps, double weight_decay, bool decoupled,
                 double grad_scale);
}  // namespace zf_cuda

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "zfunc multi-tensor CUDA Adam";
  namespace py = pybind11;
  m.def("adam_update", &zf_cuda::adam_update,
        "Fused Adam/AdamW over lists of CUDA tensors (one launch per dtype combination)",
        py::arg("params"), py::arg("grads"), py::arg("exp_avgs"), py::arg("exp_avg_sqs"),
        py::arg("lowp_params"), py::arg("step"), py::arg("lr"), py::arg("beta1"),
        py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("decoupled"),
        py::arg("grad_scale"));
}
