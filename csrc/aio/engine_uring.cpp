// io_uring back end (liburing). One ring per worker thread, sized to the
// queue depth, so a staged block always finds a free submission entry.
#include <liburing.h>
#include <string.h>
#include <unistd.h>

#include <cerrno>
#include <string>
#include <system_error>
#include <vector>

#include "aio/kernel_engine.h"

namespace zfaio {
namespace {

class UringEngine final : public KernelEngine {
 public:
  explicit UringEngine(int depth) {
    // Plain flags: SINGLE_ISSUER|DEFER_TASKRUN measured no faster here.
    int r = io_uring_queue_init(static_cast<unsigned>(depth), &ring_, 0);
    if (r < 0) throw std::system_error(-r, std::generic_category(), "io_uring_queue_init");
  }

  ~UringEngine() override { io_uring_queue_exit(&ring_); }

  void prepare(Block* b) override {
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    if (sqe == nullptr) {  // the handle never stages more than the depth
      b->result = -EBUSY;
      ready_.push_back(b);
      return;
    }
    if (b->write)
      io_uring_prep_write(sqe, b->fd, b->buf, static_cast<unsigned>(b->len), b->off);
    else
      io_uring_prep_read(sqe, b->fd, b->buf, static_cast<unsigned>(b->len), b->off);
    io_uring_sqe_set_data(sqe, b);
    in_sq_.push_back(b);
  }

  void submit() override {
    int retries = 0;
    while (!in_sq_.empty()) {
      int r = io_uring_submit(&ring_);
      if (r > 0) {
        in_sq_.erase(in_sq_.begin(), in_sq_.begin() + r);
        in_kernel_ += r;
        retries = 0;
        continue;
      }
      if (r == -EINTR) continue;
      if ((r == 0 || r == -EAGAIN || r == -EBUSY || r == -ENOMEM) && retries++ < 1000) {
        // The kernel is short of resources: let some requests finish first.
        if (in_kernel_ > 0) harvest(1); else usleep(1000);
        continue;
      }
      // The entries are still in the ring, where a later io_uring_enter could
      // pick them up: report them failed and stop using this ring.
      int err = r < 0 ? -r : EIO;
      for (Block* b : in_sq_) {
        b->result = -err;
        ready_.push_back(b);
      }
      in_sq_.clear();
      poisoned_ = true;
    }
  }

  bool poisoned() const override { return poisoned_; }

 private:
  // Wait for at least `need` completions and move every available one to ready_.
  void harvest(int need) override {
    io_uring_cqe* cqe = nullptr;
    for (;;) {
      int r = io_uring_wait_cqe_nr(&ring_, &cqe, static_cast<unsigned>(need));
      if (r == 0) break;
      if (r == -EINTR || r == -EAGAIN) continue;
      // Waiting itself failed; nothing we can do but report the blocks in
      // flight as failed, and stop using the ring.
      poisoned_ = true;
      return;
    }
    io_uring_cqe* cqes[64];
    for (;;) {
      unsigned got = io_uring_peek_batch_cqe(&ring_, cqes, 64);
      if (got == 0) break;
      for (unsigned i = 0; i < got; ++i) {
        Block* b = static_cast<Block*>(io_uring_cqe_get_data(cqes[i]));
        b->result = cqes[i]->res;
        ready_.push_back(b);
      }
      io_uring_cq_advance(&ring_, got);
      in_kernel_ -= static_cast<int>(got);
    }
  }

  io_uring ring_{};
  std::vector<Block*> in_sq_;  // prepared, not yet consumed by the kernel (FIFO)
  bool poisoned_ = false;
};

}  // namespace

std::unique_ptr<Engine> make_engine(int queue_depth) {
  return std::make_unique<UringEngine>(queue_depth);
}

const char* backend_name() { return "io_uring"; }

std::string probe() {
  io_uring ring{};
  int r = io_uring_queue_init(4, &ring, 0);
  if (r < 0) return std::string("io_uring_queue_init: ") + strerror(-r);
  std::string why;
  io_uring_probe* p = io_uring_get_probe_ring(&ring);
  if (p != nullptr) {
    if (!io_uring_opcode_supported(p, IORING_OP_READ) ||
        !io_uring_opcode_supported(p, IORING_OP_WRITE))
      why = "kernel io_uring lacks IORING_OP_READ/WRITE (needs Linux 5.6+)";
    io_uring_free_probe(p);
  }
  io_uring_queue_exit(&ring);
  return why;
}

}  // namespace zfaio
