// A CPU allocator for torch that keeps large blocks for reuse, bounded by the
// most the process ever had live at once.
//
// Why: glibc's malloc serves torch's large temporaries (a gathered unit,
// autograd's weight gradients, activations) from its heap once its dynamic
// mmap threshold has risen, and the holes they leave stay resident behind
// small live objects: zero3's peak RSS drifted towards DDP's. Forcing them to
// mmap instead (MALLOC_MMAP_THRESHOLD_) frees them at once but faults every
// page in again on the next step (about 20% slower here).
//
// What: a block of at least `min_bytes` is its own anonymous mapping (huge
// pages where the kernel offers them), rounded up to 64 KiB. A freed block is
// kept, by size, for the next request of that size: a training step asks for
// the same sizes every step, so after the first one there are almost no page
// faults. The cache never makes the process hold more than the peak of live
// large blocks: on a miss, cached blocks are unmapped (largest first) until
// cached + live + the new block fits under that peak. Smaller requests go to
// the allocator that was installed before (torch's default).
#include <torch/extension.h>
#include <c10/core/CPUAllocator.h>
#include <pthread.h>
#include <sys/mman.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <new>
#include <unordered_map>
#include <vector>

namespace {

constexpr size_t kGrain = 64 << 10;
constexpr size_t kHugePage = 2 << 20;

class LargeBlocks final : public c10::Allocator {
 public:
  LargeBlocks(c10::Allocator* fallback, size_t min_bytes) : fallback_(fallback), min_bytes_(min_bytes) {}

  c10::DataPtr allocate(size_t n) override {
    if (n < min_bytes_) return fallback_->allocate(n);
    const size_t size = (n + kGrain - 1) / kGrain * kGrain;
    void* p = nullptr;
    std::vector<std::pair<void*, size_t>> unmap;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto hit = free_.find(size);
      if (hit != free_.end() && !hit->second.empty()) {
        p = hit->second.back();
        hit->second.pop_back();
        cached_ -= size;
        ++hits_;
      } else {
        ++misses_;
        const size_t limit = std::max(peak_live_, live_ + size);
        while (cached_ > 0 && cached_ + live_ + size > limit) {
          auto largest = std::prev(free_.end());
          if (largest->second.empty()) {
            free_.erase(largest);
            continue;
          }
          unmap.emplace_back(largest->second.back(), largest->first);
          largest->second.pop_back();
          cached_ -= largest->first;
        }
      }
      live_ += size;
      peak_live_ = std::max(peak_live_, live_);
    }
    for (auto& [q, s] : unmap) munmap(q, s);
    if (p == nullptr) {
      p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (p == MAP_FAILED) {
        std::lock_guard<std::mutex> lock(mu_);
        live_ -= size;
        TORCH_CHECK(false, "zfunc large-block allocator: out of memory mapping ", size, " bytes");
      }
      if (size >= kHugePage) madvise(p, size, MADV_HUGEPAGE);
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      sizes_[p] = size;
    }
    // context == data: torch's raw_allocate/raw_deallocate paths need a simple pointer
    return {p, p, &LargeBlocks::release, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &LargeBlocks::release; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  static void release(void* p);

  void give_back(void* p) {
    std::unique_lock<std::mutex> lock(mu_);
    auto it = sizes_.find(p);
    if (it == sizes_.end()) {  // a small block, raw-allocated through us by the fallback
      lock.unlock();
      fallback_->raw_deleter()(p);
      return;
    }
    const size_t size = it->second;
    sizes_.erase(it);
    live_ -= size;
    free_[size].push_back(p);
    cached_ += size;
  }

  void empty_cache() {
    std::vector<std::pair<void*, size_t>> unmap;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& [size, blocks] : free_)
        for (void* p : blocks) unmap.emplace_back(p, size);
      free_.clear();
      cached_ = 0;
      peak_live_ = live_;
    }
    for (auto& [p, s] : unmap) munmap(p, s);
  }

  std::map<std::string, int64_t> stats() {
    std::lock_guard<std::mutex> lock(mu_);
    return {{"live_bytes", int64_t(live_)}, {"cached_bytes", int64_t(cached_)},
            {"peak_live_bytes", int64_t(peak_live_)}, {"hits", int64_t(hits_)},
            {"misses", int64_t(misses_)}, {"min_bytes", int64_t(min_bytes_)}};
  }

  // a child forked while another thread held the lock would wait forever
  void reset_lock_after_fork() { new (&mu_) std::mutex(); }

 private:
  c10::Allocator* fallback_;
  const size_t min_bytes_;
  std::mutex mu_;
  std::map<size_t, std::vector<void*>> free_;  // by size, ordered so the largest go first
  std::unordered_map<void*, size_t> sizes_;   // live blocks
  size_t live_ = 0, cached_ = 0, peak_live_ = 0, hits_ = 0, misses_ = 0;
};

LargeBlocks* g_blocks = nullptr;  // never deleted: tensors may outlive everything else

void LargeBlocks::release(void* p) { g_blocks->give_back(p); }

bool install(int64_t min_bytes) {
  TORCH_CHECK(min_bytes > 0, "min_bytes must be positive, got ", min_bytes);
  if (g_blocks != nullptr) return false;
  g_blocks = new LargeBlocks(c10::GetCPUAllocator(), size_t(min_bytes));
  c10::SetCPUAllocator(g_blocks, /*priority=*/UINT8_MAX);
  pthread_atfork(nullptr, nullptr, [] { g_blocks->reset_lock_after_fork(); });
  return true;
}

std::map<std::string, int64_t> stats() {
  return g_blocks ? g_blocks->stats() : std::map<std::string, int64_t>{};
}

void empty_cache() {
  if (g_blocks) g_blocks->empty_cache();
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("install", &install, "Make torch's CPU allocator this one (once per process); False if it already was");
  m.def("stats", &stats, "Live, cached and peak live bytes; cache hits and misses");
  m.def("empty_cache", &empty_cache, "Unmap every cached block");
}
