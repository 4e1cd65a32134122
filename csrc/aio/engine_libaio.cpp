// Linux native AIO back end (libaio). One context per worker thread.
// Native AIO is only asynchronous on O_DIRECT descriptors; on buffered ones
// io_submit completes the transfer before returning, which is still correct.
#include <libaio.h>
#include <string.h>
#include <unistd.h>

#include <cerrno>
#include <string>
#include <system_error>
#include <vector>

#include "aio/kernel_engine.h"

namespace zfaio {
namespace {

class LibaioEngine final : public KernelEngine {
 public:
  explicit LibaioEngine(int depth) : iocbs_(depth), events_(depth) {
    int r = io_setup(depth, &ctx_);
    if (r < 0) throw std::system_error(-r, std::generic_category(), "io_setup");
    for (int i = 0; i < depth; ++i) free_.push_back(&iocbs_[i]);
  }

  ~LibaioEngine() override { io_destroy(ctx_); }

  void prepare(Block* b) override {
    if (free_.empty()) {  // the handle never stages more than the depth
      b->result = -EBUSY;
      ready_.push_back(b);
      return;
    }
    iocb* cb = free_.back();
    free_.pop_back();
    if (b->write)
      io_prep_pwrite(cb, b->fd, b->buf, b->len, b->off);
    else
      io_prep_pread(cb, b->fd, b->buf, b->len, b->off);
    cb->data = b;
    staged_.push_back(cb);
  }

  void submit() override {
    size_t first = 0;
    int retries = 0;
    while (first < staged_.size()) {
      long n = static_cast<long>(staged_.size() - first);
      int r = io_submit(ctx_, n, staged_.data() + first);
      if (r > 0) {
        first += static_cast<size_t>(r);
        in_kernel_ += r;
        retries = 0;
        continue;
      }
      if (r == -EINTR) continue;
      if ((r == -EAGAIN || r == 0) && retries++ < 1000) {
        if (in_kernel_ > 0) harvest(1); else usleep(1000);
        continue;
      }
      // The kernel refused the first remaining iocb (and did not take it):
      // fail that block alone and carry on with the rest.
      iocb* cb = staged_[first++];
      Block* b = static_cast<Block*>(cb->data);
      b->result = r < 0 ? r : -EIO;
      free_.push_back(cb);
      ready_.push_back(b);
    }
    staged_.clear();
  }

 private:
  void harvest(int need) override {
    for (;;) {
      int r = io_getevents(ctx_, need, static_cast<long>(events_.size()), events_.data(), nullptr);
      if (r == -EINTR) continue;
      if (r < 0) return;  // cannot happen with a valid context
      for (int i = 0; i < r; ++i) {
        iocb* cb = events_[i].obj;
        Block* b = static_cast<Block*>(cb->data);
        // res is the byte count or -errno; res2 carries extra error detail.
        long res = static_cast<long>(events_[i].res);
        long res2 = static_cast<long>(events_[i].res2);
        b->result = (res >= 0 && res2 < 0) ? res2 : res;
        free_.push_back(cb);
        ready_.push_back(b);
      }
      in_kernel_ -= r;
      return;
    }
  }

  io_context_t ctx_ = nullptr;
  std::vector<iocb> iocbs_;
  std::vector<io_event> events_;
  std::vector<iocb*> free_, staged_;
};

}  // namespace

std::unique_ptr<Engine> make_engine(int queue_depth) {
  return std::make_unique<LibaioEngine>(queue_depth);
}

const char* backend_name() { return "libaio"; }

std::string probe() {
  io_context_t ctx = nullptr;
  int r = io_setup(1, &ctx);
  if (r < 0) return std::string("io_setup: ") + strerror(-r);
  io_destroy(ctx);
  return "";
}

}  // namespace zfaio
