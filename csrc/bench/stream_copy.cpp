// The memory-bandwidth yardstick of benchmarks/cpu_adam.py: a single-pass
// copy whose every byte is counted.
//
// dst[i] = src[i] for fp32 tensors, with non-temporal (streaming) stores where
// the CPU has them: the destination goes straight to memory without first
// being read into the cache (the write-allocate read an ordinary copy pays
// but does not count). So it moves exactly 8 bytes per element, and 8 * n /
// time is what the memory system really delivered. OpenMP threads as
// torch.get_num_threads(); the GIL is released.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <omp.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || defined(__AVX__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kChunk = 1 << 16;  // elements per work item

void copy_chunk(float* __restrict__ dst, const float* __restrict__ src, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__) || defined(__AVX__)
#if defined(__AVX512F__)
  constexpr int64_t kLanes = 16;
#else
  constexpr int64_t kLanes = 8;
#endif
  // Streaming stores need an aligned destination: plain stores up to it.
  for (; i < n && (reinterpret_cast<uintptr_t>(dst + i) % (kLanes * 4)) != 0; ++i) dst[i] = src[i];
  for (; i + kLanes <= n; i += kLanes) {
#if defined(__AVX512F__)
    _mm512_stream_ps(dst + i, _mm512_loadu_ps(src + i));
#else
    _mm256_stream_ps(dst + i, _mm256_loadu_ps(src + i));
#endif
  }
  _mm_sfence();  // streaming stores are weakly ordered: drain this thread's
#endif
  if (i < n) std::memcpy(dst + i, src + i, size_t(n - i) * sizeof(float));
}

void stream_copy(at::Tensor dst, const at::Tensor& src) {
  TORCH_CHECK_VALUE(dst.device().is_cpu() && src.device().is_cpu() && dst.is_contiguous() &&
                        src.is_contiguous(),
                    "stream_copy: dst and src must be contiguous CPU tensors");
  TORCH_CHECK_VALUE(dst.scalar_type() == at::kFloat && src.scalar_type() == at::kFloat,
                    "stream_copy: dst and src must be float32");
  TORCH_CHECK_VALUE(dst.numel() == src.numel(), "stream_copy: dst has ", dst.numel(),
                    " elements, src ", src.numel());
  float* d = dst.data_ptr<float>();
  const float* s = src.data_ptr<float>();
  const int64_t n = src.numel(), count = (n + kChunk - 1) / kChunk;
  const int nt = std::max(1, at::get_num_threads());
  pybind11::gil_scoped_release no_gil;
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
  for (int64_t c = 0; c < count; ++c)
    copy_chunk(d + c * kChunk, s + c * kChunk, std::min(kChunk, n - c * kChunk));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "single-pass streaming copy (bandwidth yardstick)";
  m.def("stream_copy", &stream_copy, "dst[:] = src with non-temporal stores (fp32)");
}
