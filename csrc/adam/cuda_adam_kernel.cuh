// The multi-tensor CUDA Adam: kernel and host logic, written once for two
// compilers. nvcc builds it into the real op (cuda_adam.cu launches the
// kernel); g++ builds it into cuda_adam_emulated.cpp, which runs the same
// kernel source block by block and thread by thread over CPU memory, so the
// kernel's math, chunking and tails are tested on machines without a GPU.
//
// Per element, math in float (as in csrc/adam/cpu_adam.cpp):
//   g = grad * grad_scale;  Adam: g += wd * p   AdamW: p *= 1 - lr * wd
//   m += (1 - beta1) * (g - m);  v = beta2 * v + (1 - beta2) * g * g
//   p -= (lr / (1 - beta1^t)) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
//   low = p (optional bf16/fp16 twin)
// Storage: params and grads fp32|bf16|fp16, state fp32, low none|bf16|fp16.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <climits>
#include <cmath>
#include <map>
#include <tuple>
#include <type_traits>
#include <vector>

namespace zf_cuda {

constexpr int64_t kChunk = 1 << 16;  // elements per block
constexpr int kThreads = 512;
constexpr int kUnroll = 4;            // independent elements in flight per thread

struct Hyper {
  float scale, one_minus_beta1, beta2, one_minus_beta2, eps, l2, decay, step_size, bias2_sqrt;
  int adamw;
};

struct TensorMeta {
  void* p;
  const void* g;
  float* m;
  float* v;
  void* low;
  int64_t n;
};

struct BlockMeta {
  int32_t tensor;
  int32_t chunk;
};

struct NoLow {};  // the kernel's L when no low-precision twin is written

template <class P, class G, class L>
__global__ void __launch_bounds__(kThreads)
    adam_kernel(const TensorMeta* __restrict__ tensors, const BlockMeta* __restrict__ blocks,
                Hyper h) {
  const BlockMeta b = blocks[blockIdx.x];
  const TensorMeta t = tensors[b.tensor];
  P* __restrict__ p = static_cast<P*>(t.p);
  const G* __restrict__ g = static_cast<const G*>(t.g);
  float* __restrict__ m = t.m;
  float* __restrict__ v = t.v;
  L* __restrict__ low = static_cast<L*>(t.low);
  const int64_t begin = int64_t(b.chunk) * kChunk;
  const int64_t end = begin + kChunk < t.n ? begin + kChunk : t.n;

  for (int64_t base = begin + threadIdx.x; base < end; base += int64_t(kThreads) * kUnroll) {
    float gr[kUnroll], pr[kUnroll], mr[kUnroll], vr[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {  // loads first: kUnroll requests in flight
      const int64_t i = base + int64_t(u) * kThreads;
      if (i < end) {
        gr[u] = static_cast<float>(g[i]);
        pr[u] = static_cast<float>(p[i]);
        mr[u] = m[i];
        vr[u] = v[i];
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + int64_t(u) * kThreads;
      if (i < end) {
        float gi = gr[u] * h.scale;
        float pi = pr[u];
        if (h.adamw) pi = pi * h.decay;
        else if (h.l2 != 0.0f) gi = gi + pi * h.l2;
        const float mi = fmaf(h.one_minus_beta1, gi - mr[u], mr[u]);
        const float vi = vr[u] * h.beta2 + h.one_minus_beta2 * gi * gi;
        m[i] = mi;
        v[i] = vi;
        const float denom = __fsqrt_rn(vi) / h.bias2_sqrt + h.eps;
        pi = pi - h.step_size * mi / denom;
        p[i] = static_cast<P>(pi);
        if constexpr (!std::is_same_v<L, NoLow>) low[i] = static_cast<L>(pi);
      }
    }
  }
}

// ------------------------------------------------------------------ host side

using Key = std::tuple<int, int, int>;  // param, grad, low (-1: none) dtypes

template <class F> void with_type(c10::ScalarType t, const char* what, F&& f) {
  switch (t) {
    case c10::ScalarType::Float: f(float{}); return;
    case c10::ScalarType::BFloat16: f(c10::BFloat16{}); return;
    case c10::ScalarType::Half: f(c10::Half{}); return;
    default: TORCH_CHECK(false, "cuda_adam: unsupported ", what, " dtype ", t);
  }
}

// Calls f(P{}, G{}, L{}) with the storage types a group's key names.
template <class F> void with_types(const Key& key, F&& f) {
  const int pt = std::get<0>(key), gt = std::get<1>(key), lt = std::get<2>(key);
  with_type(c10::ScalarType(pt), "param", [&](auto P) {
    with_type(c10::ScalarType(gt), "grad", [&](auto G) {
      if (lt < 0) return f(P, G, NoLow{});
      with_type(c10::ScalarType(lt), "low-precision param", [&](auto L) {
        if constexpr (std::is_same_v<decltype(L), float>) {
          TORCH_CHECK(false, "cuda_adam: the low-precision copy must be bf16 or fp16");
        } else {
          f(P, G, L);
        }
      });
    });
  });
}

// One block per kChunk elements of every tensor.
inline std::vector<BlockMeta> block_list(const std::vector<TensorMeta>& metas) {
  TORCH_CHECK(metas.size() <= size_t(INT32_MAX), "cuda_adam: too many tensors");
  std::vector<BlockMeta> blocks;
  for (size_t t = 0; t < metas.size(); ++t) {
    const int64_t chunks = (metas[t].n + kChunk - 1) / kChunk;
    TORCH_CHECK(chunks <= INT32_MAX, "cuda_adam: tensor too large");
    for (int64_t c = 0; c < chunks; ++c) blocks.push_back(BlockMeta{int32_t(t), int32_t(c)});
  }
  return blocks;
}

// t must sit on device, be contiguous and (when param is given) match its length.
inline void check(const at::Tensor& t, const at::Device& device, const char* what, size_t i,
                  const at::Tensor* param = nullptr) {
  TORCH_CHECK(t.device() == device, "cuda_adam: ", what, "[", i, "] is on ", t.device(),
              ", params[0] on ", device);
  TORCH_CHECK(t.is_contiguous(), "cuda_adam: ", what, "[", i, "] is not contiguous");
  TORCH_CHECK(param == nullptr || t.numel() == param->numel(), "cuda_adam: ", what, "[", i,
              "] has ", t.numel(), " elements, the param ", param->numel());
}

// Checks the lists, groups the tensors by dtype combination and calls
// launch(key, metas, blocks, hyper) once per group. Tensors must all be on
// params[0]'s device; which device that may be is the caller's concern.
template <class Launch>
void adam_update_groups(const std::vector<at::Tensor>& params,
                        const std::vector<at::Tensor>& grads,
                        const std::vector<at::Tensor>& exp_avgs,
                        const std::vector<at::Tensor>& exp_avg_sqs,
                        const std::vector<at::Tensor>& lowp, int64_t step, double lr,
                        double beta1, double beta2, double eps, double weight_decay,
                        bool decoupled, double grad_scale, Launch&& launch) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n,
              "cuda_adam: params, grads, exp_avgs and exp_avg_sqs differ in length");
  TORCH_CHECK(lowp.empty() || lowp.size() == n, "cuda_adam: lowp_params differs in length");
  TORCH_CHECK(step >= 1, "cuda_adam: step must be >= 1 (1-based, after this update)");
  if (n == 0) return;

  const double bias1 = 1.0 - std::pow(beta1, double(step));
  const double bias2 = 1.0 - std::pow(beta2, double(step));
  Hyper h;
  h.scale = float(grad_scale);
  h.one_minus_beta1 = float(1.0 - beta1);
  h.beta2 = float(beta2);
  h.one_minus_beta2 = float(1.0 - beta2);
  h.eps = float(eps);
  h.adamw = decoupled ? 1 : 0;
  h.l2 = decoupled ? 0.0f : float(weight_decay);
  h.decay = decoupled ? float(1.0 - lr * weight_decay) : 1.0f;
  h.step_size = float(lr / bias1);
  h.bias2_sqrt = float(std::sqrt(bias2));

  const at::Device device = params[0].device();
  std::map<Key, std::vector<TensorMeta>> groups;
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    check(p, device, "params", i);
    check(grads[i], device, "grads", i, &p);
    check(exp_avgs[i], device, "exp_avgs", i, &p);
    check(exp_avg_sqs[i], device, "exp_avg_sqs", i, &p);
    TORCH_CHECK(exp_avgs[i].scalar_type() == at::kFloat &&
                    exp_avg_sqs[i].scalar_type() == at::kFloat,
                "cuda_adam: exp_avgs[", i, "] and exp_avg_sqs[", i, "] must be float32");
    int lt = -1;
    void* low = nullptr;
    if (!lowp.empty()) {
      check(lowp[i], device, "lowp_params", i, &p);
      lt = int(lowp[i].scalar_type());
      low = lowp[i].data_ptr();
    }
    groups[Key{int(p.scalar_type()), int(grads[i].scalar_type()), lt}].push_back(
        TensorMeta{p.data_ptr(), grads[i].data_ptr(), exp_avgs[i].data_ptr<float>(),
                   exp_avg_sqs[i].data_ptr<float>(), low, p.numel()});
  }
  for (const auto& [key, metas] : groups) {
    const std::vector<BlockMeta> blocks = block_list(metas);
    if (!blocks.empty()) launch(key, metas, blocks, h);
  }
}

}  // namespace zf_cuda
