// The adam_update entry point that both builds of the CUDA Adam export (the
// real op, cuda_adam.cpp, and the CPU emulation, cuda_adam_emulated.cpp):
// its signature and its Python binding, written once.
#pragma once

#include <torch/csrc/utils/pybind.h>

#include <vector>

namespace zf_cuda {

using AdamUpdate = void(const std::vector<at::Tensor>& params,
                        const std::vector<at::Tensor>& grads,
                        const std::vector<at::Tensor>& exp_avgs,
                        const std::vector<at::Tensor>& exp_avg_sqs,
                        const std::vector<at::Tensor>& lowp, int64_t step, double lr,
                        double beta1, double beta2, double eps, double weight_decay,
                        bool decoupled, double grad_scale);

inline void def_adam_update(pybind11::module_& m, AdamUpdate* fn, const char* doc) {
  namespace py = pybind11;
  m.def("adam_update", fn, doc, py::arg("params"), py::arg("grads"), py::arg("exp_avgs"),
        py::arg("exp_avg_sqs"), py::arg("lowp_params"), py::arg("step"), py::arg("lr"),
        py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"),
        py::arg("decoupled"), py::arg("grad_scale"));
}

}  // namespace zf_cuda
