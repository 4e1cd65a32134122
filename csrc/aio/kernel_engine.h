// What the back ends whose requests the kernel completes (engine_uring.cpp,
// engine_libaio.cpp) share: the blocks finished or refused but not yet reaped,
// the count the kernel holds, and reap() over them. Each back end says how it
// collects completions from the kernel (harvest).
#pragma once

#include <deque>

#include "aio/aio.h"

namespace zfaio {

class KernelEngine : public Engine {
 public:
  int reap(int min_complete, Block** out, int max) final {
    int n = 0;
    while (n < max && !ready_.empty()) {
      out[n++] = ready_.front();
      ready_.pop_front();
    }
    int need = min_complete - n;
    if (need > in_kernel_) need = in_kernel_;
    if (need > 0) harvest(need);
    while (n < max && !ready_.empty()) {
      out[n++] = ready_.front();
      ready_.pop_front();
    }
    return n;
  }

 protected:
  // Wait for at least `need` completions and move those collected to ready_.
  virtual void harvest(int need) = 0;

  std::deque<Block*> ready_;  // finished (or refused), not yet reaped
  int in_kernel_ = 0;         // submitted to the kernel, not yet harvested
};

}  // namespace zfaio
