// Back end of last resort: `queue_depth` threads doing blocking pread/pwrite.
// Works wherever POSIX does; no kernel async interface needed.
#include <unistd.h>

#include <cerrno>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include "aio/aio.h"

namespace zfaio {
namespace {

// Move the whole block, looping over partial transfers; stop early only at end
// of file (a read returning 0) or on an error.
long transfer(Block* b) {
  size_t done = 0;
  while (done < b->len) {
    ssize_t r = b->write ? ::pwrite(b->fd, b->buf + done, b->len - done, b->off + done)
                         : ::pread(b->fd, b->buf + done, b->len - done, b->off + done);
    if (r < 0) {
      if (errno == EINTR) continue;
      return -errno;
    }
    if (r == 0) break;
    done += static_cast<size_t>(r);
  }
  return static_cast<long>(done);
}

class ThreadEngine final : public Engine {
 public:
  explicit ThreadEngine(int depth) {
    threads_.reserve(depth);
    for (int i = 0; i < depth; ++i) threads_.emplace_back([this] { run(); });
  }

  ~ThreadEngine() override {
    {
      std::lock_guard<std::mutex> g(mu_);
      stop_ = true;
    }
    todo_cv_.notify_all();
    for (auto& t : threads_) t.join();
  }

  void prepare(Block* b) override { staged_.push_back(b); }

  void submit() override {
    if (staged_.empty()) return;
    {
      std::lock_guard<std::mutex> g(mu_);
      for (Block* b : staged_) todo_.push_back(b);
      outstanding_ += static_cast<int>(staged_.size());
    }
    if (staged_.size() == 1) todo_cv_.notify_one(); else todo_cv_.notify_all();
    staged_.clear();
  }

  int reap(int min_complete, Block** out, int max) override {
    std::unique_lock<std::mutex> g(mu_);
    if (min_complete > outstanding_) min_complete = outstanding_;
    done_cv_.wait(g, [&] { return static_cast<int>(done_.size()) >= min_complete; });
    int n = 0;
    while (n < max && !done_.empty()) {
      out[n++] = done_.front();
      done_.pop_front();
    }
    outstanding_ -= n;
    return n;
  }

 private:
  void run() {
    std::unique_lock<std::mutex> g(mu_);
    for (;;) {
      todo_cv_.wait(g, [&] { return stop_ || !todo_.empty(); });
      if (todo_.empty()) return;  // stop_ and nothing left
      Block* b = todo_.front();
      todo_.pop_front();
      g.unlock();
      b->result = transfer(b);
      g.lock();
      done_.push_back(b);
      done_cv_.notify_one();
    }
  }

  std::vector<Block*> staged_;  // touched only by the owning worker
  std::mutex mu_;
  std::condition_variable todo_cv_, done_cv_;
  std::deque<Block*> todo_, done_;
  int outstanding_ = 0;  // submitted and not yet reaped
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace

std::unique_ptr<Engine> make_engine(int queue_depth) {
  return std::make_unique<ThreadEngine>(queue_depth);
}

const char* backend_name() { return "threads"; }

std::string probe() { return ""; }

}  // namespace zfaio
