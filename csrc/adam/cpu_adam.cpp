// Fused Adam/AdamW for CPU tensors: one pass per element over many tensors.
//
// Per element (math in float, whatever the storage types):
//   g  = grad * grad_scale                       (unscale x clip factor folded in)
//   Adam:  g += weight_decay * p     AdamW:  p *= 1 - lr * weight_decay
//   m  = m + (1 - beta1) * (g - m)               (m.lerp_(g, 1 - beta1), one fma)
//   v  = beta2 * v + (1 - beta2) * g * g
//   p -= (lr / (1 - beta1^t)) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
//   low = p                                      (optional bf16/fp16 twin)
// The operation order is that of torch's Adam (lerp for m, division by the
// bias-corrected sqrt(v)), so fp32 results agree with torch.optim.AdamW to fp32
// rounding. Storage types: param float|bf16, grad
// float|bf16|fp16, state float|bf16, low-precision copy none|bf16|fp16.
//
// All tensors of a call are cut into chunks; OpenMP threads (as many as
// at::get_num_threads(), i.e. torch.set_num_threads / OMP_NUM_THREADS) take
// contiguous runs of chunks. The GIL is released while the kernel runs.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <omp.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "cpu_simd.h"

namespace zf {
namespace {

constexpr int64_t kChunk = 1 << 16;  // elements per work item (256 KiB of fp32)

struct Hyper {
  float scale, beta1, one_minus_beta1, beta2, one_minus_beta2, eps;
  float l2;     // Adam: weight decay added to the gradient (0 for AdamW)
  float decay;  // AdamW: 1 - lr * weight_decay (1 for Adam)
  float step_size, bias2_sqrt;
  bool adamw;
};

// m.lerp_(g, w) for the small weights Adam uses: m + w * (g - m), fused.
inline float lerp(float m, float g, float w) {
#ifdef __FMA__
  return std::fma(w, g - m, m);
#else
  return m + w * (g - m);
#endif
}

using KernelFn = void (*)(void* p, const void* g, void* m, void* v, void* low, int64_t n,
                          const Hyper& h);

#ifdef ZFUNC_AVX512
template <bool Masked, class P, class G, class S, class L>
inline void adam16(P* p, const G* g, S* m, S* v, L* low, __mmask16 k, const Hyper& h) {
  vf gv = _mm512_mul_ps(vload<Masked>(g, k), _mm512_set1_ps(h.scale));
  vf pv = vload<Masked>(p, k);
  if (h.adamw) pv = _mm512_mul_ps(pv, _mm512_set1_ps(h.decay));
  else if (h.l2 != 0.0f) gv = _mm512_add_ps(gv, _mm512_mul_ps(pv, _mm512_set1_ps(h.l2)));
  vf mv = vload<Masked>(m, k);
  mv = _mm512_fmadd_ps(_mm512_set1_ps(h.one_minus_beta1), _mm512_sub_ps(gv, mv), mv);
  vf vv = _mm512_add_ps(_mm512_mul_ps(vload<Masked>(v, k), _mm512_set1_ps(h.beta2)),
                        _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(h.one_minus_beta2), gv), gv));
  vstore<Masked>(m, mv, k);
  vstore<Masked>(v, vv, k);
  vf denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(vv), _mm512_set1_ps(h.bias2_sqrt)),
                           _mm512_set1_ps(h.eps));
  pv = _mm512_sub_ps(pv, _mm512_div_ps(_mm512_mul_ps(_mm512_set1_ps(h.step_size), mv), denom));
  vstore<Masked>(p, pv, k);
  if constexpr (!std::is_same_v<L, none>) vstore<Masked>(low, pv, k);
}
#endif

#ifndef ZFUNC_AVX512
// Portable path: the update on float arrays, in the same operation order. gcc
// -O3 -fno-math-errno vectorises this loop, and the conversion loops below,
// separately; it does not vectorise one loop that mixes 2- and 4-byte storage.
inline void adam_f32(float* __restrict__ p, const float* __restrict__ g, float* __restrict__ m,
                     float* __restrict__ v, int64_t n, const Hyper& h) {
  const float scale = h.scale, c1 = h.one_minus_beta1, b2 = h.beta2, c2 = h.one_minus_beta2,
              eps = h.eps, l2 = h.l2, decay = h.decay, step_size = h.step_size,
              bias2_sqrt = h.bias2_sqrt;
  const bool adamw = h.adamw;
  for (int64_t i = 0; i < n; ++i) {
    float gi = g[i] * scale;
    float pi = p[i];
    if (adamw) pi = pi * decay;
    else if (l2 != 0.0f) gi = gi + pi * l2;
    const float mi = lerp(m[i], gi, c1);
    const float vi = v[i] * b2 + c2 * gi * gi;
    m[i] = mi;
    v[i] = vi;
    p[i] = pi - step_size * mi / (std::sqrt(vi) / bias2_sqrt + eps);
  }
}

template <class T> void widen(const T* __restrict__ src, float* __restrict__ dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = load_f32(src, i);
}
template <class T> void narrow(const float* __restrict__ src, T* __restrict__ dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) store_f32(dst, i, src[i]);
}

// Float storage is used in place; other storage goes through an L1-sized buffer.
template <class T> float* work(T* x, float* buf, int64_t n, bool load) {
  if constexpr (std::is_same_v<T, float>) return x;
  else { if (load) widen(x, buf, n); return buf; }
}
template <class T> void finish(T* x, const float* buf, int64_t n) {
  if constexpr (!std::is_same_v<T, float>) narrow(buf, x, n);
}
#endif

template <class P, class G, class S, class L>
void adam_kernel(void* p_, const void* g_, void* m_, void* v_, void* low_, int64_t n,
                 const Hyper& h) {
  P* p = static_cast<P*>(p_);
  const G* g = static_cast<const G*>(g_);
  S* m = static_cast<S*>(m_);
  S* v = static_cast<S*>(v_);
  L* low = static_cast<L*>(low_);
  constexpr bool kLow = !std::is_same_v<L, none>;
#ifdef ZFUNC_AVX512
  // Software prefetch a few KiB ahead on the four read streams: measured 5-15%
  // faster than leaving it to the hardware prefetchers on Zen 5 (prefetches
  // past the end of an array never fault).
  constexpr int64_t kAhead = 512;
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    _mm_prefetch(reinterpret_cast<const char*>(p + i + kAhead), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(g + i + kAhead), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(m + i + kAhead), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(v + i + kAhead), _MM_HINT_T0);
    adam16<false>(p + i, g + i, m + i, v + i, kLow ? low + i : nullptr, 0, h);
  }
  if (i < n)
    adam16<true>(p + i, g + i, m + i, v + i, kLow ? low + i : nullptr, tail_mask(n - i), h);
#else
  constexpr int64_t kBlock = 512;
  alignas(64) float pb[kBlock], gb[kBlock], mb[kBlock], vb[kBlock];
  for (int64_t i = 0; i < n; i += kBlock) {
    const int64_t k = std::min(kBlock, n - i);
    float* pw = work(p + i, pb, k, true);
    float* mw = work(m + i, mb, k, true);
    float* vw = work(v + i, vb, k, true);
    const float* gw = work(const_cast<G*>(g + i), gb, k, true);
    adam_f32(pw, gw, mw, vw, k, h);
    finish(p + i, pw, k);
    finish(m + i, mw, k);
    finish(v + i, vw, k);
    if constexpr (kLow) narrow(pw, low + i, k);
  }
#endif
}

// ------------------------------------------------------------- dispatch
// Calls f with a value of the storage type for t; false if t is not one of them.
template <class F> bool with_type(c10::ScalarType t, bool allow_half, F&& f) {
  switch (t) {
    case c10::ScalarType::Float: f(float{}); return true;
    case c10::ScalarType::BFloat16: f(bf16{}); return true;
    case c10::ScalarType::Half:
      if (allow_half) { f(f16{}); return true; }
      return false;
    default: return false;
  }
}

// The kernel for these storage types, or nullptr if the kernel does not take them.
KernelFn pick_kernel(c10::ScalarType pt, c10::ScalarType gt, c10::ScalarType st,
                     std::optional<c10::ScalarType> lt) {
  KernelFn fn = nullptr;
  with_type(pt, false, [&](auto P) {
    with_type(gt, true, [&](auto G) {
      with_type(st, false, [&](auto S) {
        using TP = decltype(P); using TG = decltype(G); using TS = decltype(S);
        if (!lt) { fn = &adam_kernel<TP, TG, TS, none>; return; }
        with_type(*lt, true, [&](auto L) {
          using TL = decltype(L);
          if constexpr (!std::is_same_v<TL, float>) fn = &adam_kernel<TP, TG, TS, TL>;
        });
      });
    });
  });
  return fn;
}

struct Item {
  KernelFn fn;
  char *p, *m, *v, *low;
  const char* g;
  int64_t n;
};

bool usable(const at::Tensor& t) { return t.device().is_cpu() && t.is_contiguous(); }

void check_numel(const at::Tensor& t, const at::Tensor& p, const char* what, size_t i) {
  TORCH_CHECK_VALUE(t.numel() == p.numel(), "adam_update_: ", what, "[", i, "] has ", t.numel(),
                    " elements, params[", i, "] has ", p.numel());
}

int threads_for(int64_t total) {
  int nt = at::get_num_threads();
  return total < 2 * kChunk ? 1 : std::max(1, nt);
}

// Updates every tensor it can take and returns the indices of those it cannot
// (not on the CPU, not contiguous, or storage types it has no kernel for), for
// the caller to update another way.
std::vector<int64_t> adam_update(
    const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
    const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
    const std::vector<at::Tensor>& lowp, int64_t step, double lr, double beta1, double beta2,
    double eps, double weight_decay, bool decoupled, double grad_scale) {
  const size_t n = params.size();
  TORCH_CHECK_VALUE(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n,
                    "adam_update_: params, grads, exp_avgs and exp_avg_sqs differ in length");
  TORCH_CHECK_VALUE(lowp.empty() || lowp.size() == n,
                    "adam_update_: lowp_params differs in length from params");
  TORCH_CHECK_VALUE(step >= 1, "adam_update_: step must be >= 1 (1-based, after this update)");

  // Scalars as torch computes them: in double, then rounded to float.
  const double bias1 = 1.0 - std::pow(beta1, double(step));
  const double bias2 = 1.0 - std::pow(beta2, double(step));
  Hyper h;
  h.scale = float(grad_scale);
  h.beta1 = float(beta1);
  h.one_minus_beta1 = float(1.0 - beta1);
  h.beta2 = float(beta2);
  h.one_minus_beta2 = float(1.0 - beta2);
  h.eps = float(eps);
  h.adamw = decoupled;
  h.l2 = decoupled ? 0.0f : float(weight_decay);
  h.decay = decoupled ? float(1.0 - lr * weight_decay) : 1.0f;
  h.step_size = float(lr / bias1);
  h.bias2_sqrt = float(std::sqrt(bias2));

  std::vector<Item> items;
  std::vector<int64_t> skipped;
  int64_t total = 0;
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor &p = params[i], &g = grads[i], &m = exp_avgs[i], &v = exp_avg_sqs[i];
    check_numel(g, p, "grads", i);
    check_numel(m, p, "exp_avgs", i);
    check_numel(v, p, "exp_avg_sqs", i);
    if (!lowp.empty()) check_numel(lowp[i], p, "lowp_params", i);
    KernelFn fn = nullptr;
    if (usable(p) && usable(g) && usable(m) && usable(v) && (lowp.empty() || usable(lowp[i])) &&
        m.scalar_type() == v.scalar_type()) {
      std::optional<c10::ScalarType> lt;
      if (!lowp.empty()) lt = lowp[i].scalar_type();
      fn = pick_kernel(p.scalar_type(), g.scalar_type(), m.scalar_type(), lt);
    }
    if (fn == nullptr) {
      skipped.push_back(int64_t(i));
      continue;
    }
    const int64_t numel = p.numel();
    char* pp = static_cast<char*>(p.data_ptr());
    const char* gp = static_cast<const char*>(g.data_ptr());
    char* mp = static_cast<char*>(m.data_ptr());
    char* vp = static_cast<char*>(v.data_ptr());
    char* lp = lowp.empty() ? nullptr : static_cast<char*>(lowp[i].data_ptr());
    const int64_t ps = p.element_size(), gs = g.element_size(), ss = m.element_size(),
                  ls = lowp.empty() ? 0 : lowp[i].element_size();
    for (int64_t b = 0; b < numel; b += kChunk) {
      items.push_back(Item{fn, pp + b * ps, mp + b * ss, vp + b * ss, lp ? lp + b * ls : nullptr,
                           gp + b * gs, std::min(kChunk, numel - b)});
    }
    total += numel;
  }

  pybind11::gil_scoped_release no_gil;
  const int nt = threads_for(total);
  const int64_t count = int64_t(items.size());
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
  for (int64_t i = 0; i < count; ++i) {
    const Item& it = items[i];
    it.fn(it.p, it.g, it.m, it.v, it.low, it.n, h);
  }
  return skipped;
}

// ------------------------------------------------- sum of squares + finite check
#ifndef ZFUNC_AVX512
constexpr int kPart = 8;
// acc[l] += x[j]^2 for j = l (mod kPart); the tail goes to acc[0].
inline void add_squares(const float* __restrict__ x, int64_t n, double* __restrict__ acc) {
  int64_t j = 0;
  for (; j + kPart <= n; j += kPart)
    for (int l = 0; l < kPart; ++l) acc[l] += double(x[j + l]) * double(x[j + l]);
  for (; j < n; ++j) acc[0] += double(x[j]) * double(x[j]);
}
// x * 0 is NaN, so != 0, exactly when x is inf or NaN.
inline int any_nonfinite(const float* __restrict__ x, int64_t n) {
  int bad = 0;
  for (int64_t j = 0; j < n; ++j) bad |= (x[j] * 0.0f != 0.0f);
  return bad;
}
#endif

template <class T> void sumsq_kernel(const void* x_, int64_t n, double* sumsq, bool* finite) {
  const T* x = static_cast<const T*>(x_);
  int64_t i = 0;
#ifdef ZFUNC_AVX512
  __m512d a0 = _mm512_setzero_pd(), a1 = _mm512_setzero_pd();
  __mmask16 bad = 0;
  auto body = [&](vf f) {
    // x * 0 is NaN exactly when x is inf or NaN.
    vf z = _mm512_mul_ps(f, _mm512_setzero_ps());
    bad |= _mm512_cmp_ps_mask(z, z, _CMP_UNORD_Q);
    __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(f));
    __m512d hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(f), 1)));
    a0 = _mm512_fmadd_pd(lo, lo, a0);
    a1 = _mm512_fmadd_pd(hi, hi, a1);
  };
  for (; i + kLanes <= n; i += kLanes) body(vload<false>(x + i, 0));
  if (i < n) body(vload<true>(x + i, tail_mask(n - i)));
  *sumsq = _mm512_reduce_add_pd(_mm512_add_pd(a0, a1));
  *finite = bad == 0;
#else
  // Eight independent partial sums (a fixed order, so gcc vectorises them
  // without reassociating), and a separate finiteness loop: gcc vectorises
  // each alone, not the two fused.
  constexpr int64_t kBlock = 512;
  alignas(64) float buf[kBlock];
  alignas(64) double acc[kPart] = {};
  int bad = 0;
  for (; i < n; i += kBlock) {
    const int64_t k = std::min(kBlock, n - i);
    const float* f = work(const_cast<T*>(x + i), buf, k, true);
    bad |= any_nonfinite(f, k);
    add_squares(f, k, acc);
  }
  double total = 0.0;
  for (int l = 0; l < kPart; ++l) total += acc[l];
  *sumsq = total;
  *finite = bad == 0;
#endif
}

// (sum of squares in double, all finite, indices of the tensors not taken:
// not on the CPU, not contiguous, or not float/bf16/fp16).
std::tuple<double, bool, std::vector<int64_t>> nonfinite_and_sq_norm(
    const std::vector<at::Tensor>& xs) {
  using Fn = void (*)(const void*, int64_t, double*, bool*);
  struct Job { Fn fn; const char* x; int64_t n; };
  std::vector<Job> jobs;
  std::vector<int64_t> skipped;
  int64_t total = 0;
  for (size_t i = 0; i < xs.size(); ++i) {
    const at::Tensor& t = xs[i];
    Fn fn = nullptr;
    if (usable(t)) with_type(t.scalar_type(), true, [&](auto T) { fn = &sumsq_kernel<decltype(T)>; });
    if (fn == nullptr) {
      skipped.push_back(int64_t(i));
      continue;
    }
    const char* ptr = static_cast<const char*>(t.data_ptr());
    for (int64_t b = 0; b < t.numel(); b += kChunk)
      jobs.push_back(Job{fn, ptr + b * t.element_size(), std::min(kChunk, t.numel() - b)});
    total += t.numel();
  }
  std::vector<double> sums(jobs.size(), 0.0);
  std::vector<char> ok(jobs.size(), 1);
  {
    pybind11::gil_scoped_release no_gil;
    const int nt = threads_for(total);
    const int64_t count = int64_t(jobs.size());
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int64_t i = 0; i < count; ++i) {
      bool f = true;
      jobs[i].fn(jobs[i].x, jobs[i].n, &sums[i], &f);
      ok[i] = f;
    }
  }
  // Chunk sums are added in a fixed order: the result does not depend on the
  // number of threads.
  double s = 0.0;
  bool finite = true;
  for (size_t i = 0; i < jobs.size(); ++i) { s += sums[i]; finite &= ok[i] != 0; }
  return {s, finite && std::isfinite(s), skipped};
}

std::string simd() {
#ifdef ZFUNC_AVX512
  return "avx512";
#elif defined(__AVX2__)
  return "avx2 (auto-vectorised)";
#else
  return "portable (auto-vectorised)";
#endif
}

}  // namespace
}  // namespace zf

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "zfunc fused CPU Adam";
  m.def("adam_update", &zf::adam_update,
        "Fused Adam/AdamW over lists of CPU tensors; returns the indices it did not take",
        pybind11::arg("params"), pybind11::arg("grads"), pybind11::arg("exp_avgs"),
        pybind11::arg("exp_avg_sqs"), pybind11::arg("lowp_params"), pybind11::arg("step"),
        pybind11::arg("lr"), pybind11::arg("beta1"), pybind11::arg("beta2"),
        pybind11::arg("eps"), pybind11::arg("weight_decay"), pybind11::arg("decoupled"),
        pybind11::arg("grad_scale"));
  m.def("nonfinite_and_sq_norm", &zf::nonfinite_and_sq_norm,
        "(sum of squares in double, all finite, indices not taken) over a list of tensors");
  m.def("simd", &zf::simd, "which code path was compiled");
}
