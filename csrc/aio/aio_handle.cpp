// The asynchronous I/O handle: splits each request into blocks, spreads them
// over `thread_count` worker threads, each driving its own engine (io_uring,
// libaio or a thread pool, chosen at build time) with up to `queue_depth`
// blocks in flight, and reports completions and errors back to Python.
//
// Alignment: the page-aligned middle of a request goes through an O_DIRECT
// descriptor; an unaligned head or tail (or a buffer whose address does not
// line up with the file offset) goes through an ordinary buffered one. Direct
// blocks therefore only ever cover whole pages owned by one request.
#include <fcntl.h>
#include <pybind11/pybind11.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "aio/aio.h"

namespace py = pybind11;

namespace zfaio {
namespace {

// What went wrong with one request, ready to become a Python exception:
// OSError(err, msg, path) or, for a read that hit end of file, EOFError(msg).
struct Failure {
  int err = 0;
  bool eof = false;
  std::string path;
  std::string msg;
};

std::string describe(bool write, size_t len, long long off) {
  return std::string(write ? "writing " : "reading ") + std::to_string(len) +
         " bytes at offset " + std::to_string(off);
}

struct Request {
  bool write = false;
  bool atomic = false;    // write io_path, fsync, rename to path
  bool fsync = false;     // fsync after a plain write
  std::string path;       // what the caller named
  std::string io_path;    // what we open: path, or path + ".partial"
  int fd_direct = -1;     // O_DIRECT descriptor, or -1
  int fd_buffered = -1;   // always open
  long long offset = 0;
  size_t nbytes = 0;
  long long grown_from = -1;  // size before we extended the file for this write
  long long grown_to = -1;
  int inject_errno = 0;   // fault injection: fail blocks past inject_after
  size_t inject_after = 0;
  std::atomic<int> parts_left{0};
  std::atomic<bool> failed{false};
  std::mutex mu;
  Failure failure;        // the first one

  ~Request() {
    if (fd_direct >= 0) ::close(fd_direct);
    if (fd_buffered >= 0) ::close(fd_buffered);
  }

  void fail(int err, const std::string& what) {
    std::lock_guard<std::mutex> g(mu);
    if (failed.load()) return;
    failure.err = err;
    failure.path = path;
    failure.msg = std::string(strerror(err)) + " while " + what;
    if (io_path != path) failure.msg += " of temporary '" + io_path + "'";
    failed.store(true);
  }

  void fail_eof(size_t got, size_t len, long long off) {
    std::lock_guard<std::mutex> g(mu);
    if (failed.load()) return;
    failure.eof = true;
    failure.path = path;
    failure.msg = "short read from '" + path + "': got " + std::to_string(got) + " of " +
                  std::to_string(len) + " bytes at offset " + std::to_string(off) +
                  " (end of file)";
    failed.store(true);
  }
};

}  // namespace

// Declared in aio.h (blocks point back at their part), so not file-local.
struct Segment {
  int fd;
  char* buf;
  size_t len;
  long long off;
};

// One worker's share of a request: up to three segments (buffered head,
// direct middle, buffered tail) cut into blocks as the queue has room.
struct Part {
  std::shared_ptr<Request> req;
  Segment seg[3];
  int nseg = 0;
  int cur = 0;          // segment being cut
  size_t cursor = 0;    // bytes of seg[cur] already cut
  int outstanding = 0;  // blocks in flight
  bool all_cut = false;
};

namespace {

class Handle;

class Worker {
 public:
  Worker(Handle* h, int depth, size_t block_size, bool single_submit, bool overlap)
      : handle_(h), depth_(depth), block_size_(block_size), single_submit_(single_submit),
        overlap_(overlap), slots_(depth), busy_(depth, 0) {
    for (int i = depth - 1; i >= 0; --i) {
      slots_[i].slot = i;
      free_.push_back(i);
    }
    done_.resize(depth);
    // The engine is made on the thread that uses it (an io_uring ring may be
    // tied to its submitting thread); a failure is rethrown here.
    std::promise<void> ready;
    std::future<void> made = ready.get_future();
    thread_ = std::thread([this, &ready] {
      try {
        engine_ = make_engine(depth_);
      } catch (...) {
        ready.set_exception(std::current_exception());
        return;
      }
      ready.set_value();
      loop();
    });
    try {
      made.get();
    } catch (...) {
      thread_.join();
      throw;
    }
  }

  ~Worker() {
    {
      std::lock_guard<std::mutex> g(mu_);
      stop_ = true;
    }
    cv_.notify_one();
    thread_.join();
  }

  void push(Part* p) {
    {
      std::lock_guard<std::mutex> g(mu_);
      queue_.push_back(p);
    }
    cv_.notify_one();
  }

 private:
  void loop();
  Block* next_block();
  void complete(Block* b);
  void part_done_maybe(Part* p);
  void fail_everything(int err);

  Handle* handle_;
  const int depth_;
  const size_t block_size_;
  const bool single_submit_, overlap_;
  std::unique_ptr<Engine> engine_;
  std::vector<Block> slots_;
  std::vector<char> busy_;
  std::vector<int> free_;
  std::vector<Block*> done_;
  std::deque<Part*> active_;  // parts with blocks still to cut
  int inflight_ = 0;
  bool broken_ = false;

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Part*> queue_;
  bool stop_ = false;
  std::thread thread_;
};

class Handle {
 public:
  Handle(size_t block_size, int queue_depth, int thread_count, bool single_submit,
         bool overlap_events)
      : block_size_(block_size), queue_depth_(queue_depth), thread_count_(thread_count),
        single_submit_(single_submit), overlap_events_(overlap_events) {
    if (block_size == 0 || block_size % kAlign != 0)
      throw std::invalid_argument("block_size must be a positive multiple of " +
                                  std::to_string(kAlign) + ", got " + std::to_string(block_size));
    if (block_size > (size_t{1} << 30))  // completions report an int byte count
      throw std::invalid_argument("block_size must be at most 1 GiB");
    if (queue_depth < 1) throw std::invalid_argument("queue_depth must be >= 1");
    if (thread_count < 1) throw std::invalid_argument("thread_count must be >= 1");
    for (int i = 0; i < thread_count; ++i)
      workers_.emplace_back(std::make_unique<Worker>(this, queue_depth, block_size, single_submit,
                                                     overlap_events));
  }

  // Workers drain everything queued before they stop, so no buffer is
  // touched after the handle is gone.
  ~Handle() { workers_.clear(); }

  // Opens the file now (so a bad path raises at once) and queues the transfer.
  void submit(bool write, uintptr_t addr, size_t nbytes, const std::string& path,
              long long offset, bool atomic, bool fsync) {
    if (offset < 0) throw std::invalid_argument("offset must be >= 0");
    if (broken_.load())
      throw std::runtime_error("this aio handle stopped after an unrecoverable " +
                               std::string(backend_name()) + " error; create a new one");
    auto req = std::make_shared<Request>();
    req->write = write;
    req->atomic = write && atomic;
    req->fsync = write && fsync;
    req->path = path;
    req->io_path = req->atomic ? path + ".partial" : path;
    req->offset = offset;
    req->nbytes = nbytes;
    {
      std::lock_guard<std::mutex> g(mu_);
      req->inject_errno = inject_errno_;
      req->inject_after = inject_after_;
      inject_errno_ = 0;
    }
    try {
      open_files(*req, addr);
    } catch (...) {
      if (req->atomic && req->fd_buffered >= 0) ::unlink(req->io_path.c_str());
      throw;
    }

    char* buf = reinterpret_cast<char*>(addr);
    size_t head = 0, body = nbytes, tail = 0;
    int body_fd = req->fd_buffered;
    if (req->fd_direct >= 0) {
      head = std::min(nbytes, static_cast<size_t>((kAlign - offset % kAlign) % kAlign));
      body = (nbytes - head) / kAlign * kAlign;
      tail = nbytes - head - body;
      body_fd = req->fd_direct;
    }
    size_t chunk = (body + thread_count_ - 1) / thread_count_;
    chunk = std::max(block_size_, (chunk + block_size_ - 1) / block_size_ * block_size_);
    int nparts = body == 0 ? 1 : static_cast<int>((body + chunk - 1) / chunk);

    std::vector<Part*> parts;
    for (int i = 0; i < nparts; ++i) {
      Part* p = new Part();
      p->req = req;
      if (i == 0 && head > 0) p->seg[p->nseg++] = {req->fd_buffered, buf, head, offset};
      size_t b0 = static_cast<size_t>(i) * chunk, b1 = std::min(body, b0 + chunk);
      if (b1 > b0)
        p->seg[p->nseg++] = {body_fd, buf + head + b0, b1 - b0,
                             offset + static_cast<long long>(head + b0)};
      if (i == nparts - 1 && tail > 0)
        p->seg[p->nseg++] = {req->fd_buffered, buf + head + body, tail,
                             offset + static_cast<long long>(head + body)};
      parts.push_back(p);
    }
    req->parts_left.store(nparts);
    {
      std::lock_guard<std::mutex> g(mu_);
      ++inflight_;
    }
    if (nbytes == 0) {  // nothing to move; still honour atomic/fsync
      delete parts[0];
      req->parts_left.store(0);
      finish(req.get());
      return;
    }
    std::lock_guard<std::mutex> g(submit_mu_);
    for (size_t i = 0; i < parts.size(); ++i)
      workers_[(next_worker_ + i) % workers_.size()]->push(parts[i]);
    next_worker_ = (next_worker_ + parts.size()) % workers_.size();
  }

  // Blocks until nothing is in flight. Returns the number of requests finished
  // since the last wait(), or throws the first failure among them.
  int wait() {
    std::unique_lock<std::mutex> g(mu_);
    cv_.wait(g, [&] { return inflight_ == 0; });
    int n = completed_;
    completed_ = 0;
    std::vector<Failure> failures;
    failures.swap(failures_);
    g.unlock();
    if (!failures.empty()) {
      Failure f = failures.front();
      if (failures.size() > 1)
        f.msg += " (and " + std::to_string(failures.size() - 1) + " more failed requests)";
      throw f;
    }
    return n;
  }

  int poll() {
    std::lock_guard<std::mutex> g(mu_);
    return inflight_;
  }

  void inject_error(int err, size_t after_bytes) {
    std::lock_guard<std::mutex> g(mu_);
    inject_errno_ = err;
    inject_after_ = after_bytes;
  }

  bool broken() const { return broken_.load(); }
  void set_broken() { broken_.store(true); }

  // Last part of a request is done: make an atomic write durable and visible
  // (or remove its temporary), close the files, and count it.
  void finish(Request* r) {
    if (r->write && !r->failed.load() && (r->atomic || r->fsync)) {
      if (::fsync(r->fd_buffered) != 0) r->fail(errno, "fsync after " + describe(true, r->nbytes, r->offset));
    }
    if (r->atomic) {
      if (!r->failed.load()) {
        if (::rename(r->io_path.c_str(), r->path.c_str()) != 0) {
          r->fail(errno, "renaming '" + r->io_path + "' to '" + r->path + "'");
        } else {
          std::string dir = r->path.substr(0, r->path.find_last_of('/') + 1);
          int dfd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
          if (dfd >= 0) {
            ::fsync(dfd);
            ::close(dfd);
          }
        }
      }
      if (r->failed.load()) {
        ::unlink(r->io_path.c_str());
        std::lock_guard<std::mutex> g(r->mu);
        r->failure.msg += "; the temporary was removed and '" + r->path + "' was not written";
      }
    }
    if (!r->atomic && r->failed.load() && r->grown_from >= 0) {
      // Undo our extension unless a later write grew the file further.
      struct stat st;
      if (::fstat(r->fd_buffered, &st) == 0 && st.st_size == r->grown_to)
        if (::ftruncate(r->fd_buffered, r->grown_from) != 0) { /* keep the first error */ }
    }
    if (r->fd_direct >= 0) ::close(r->fd_direct);
    if (r->fd_buffered >= 0) ::close(r->fd_buffered);
    r->fd_direct = r->fd_buffered = -1;
    {
      std::lock_guard<std::mutex> g(mu_);
      --inflight_;
      ++completed_;
      if (r->failed.load()) failures_.push_back(r->failure);
    }
    cv_.notify_all();
  }

  size_t block_size() const { return block_size_; }
  int queue_depth() const { return queue_depth_; }
  int thread_count() const { return thread_count_; }
  bool single_submit() const { return single_submit_; }
  bool overlap_events() const { return overlap_events_; }

 private:
  static Failure open_failure(int err, const Request& r, const char* how) {
    Failure f;
    f.err = err;
    f.path = r.path;
    f.msg = std::string(strerror(err)) + " while opening for " + how + " (" +
            describe(r.write, r.nbytes, r.offset) + ")";
    if (err == ENOENT && r.write) {
      size_t slash = r.path.find_last_of('/');
      if (slash != std::string::npos && slash > 0) {
        std::string dir = r.path.substr(0, slash);
        struct stat st;
        if (::stat(dir.c_str(), &st) != 0)
          f.msg += "; directory '" + dir + "' does not exist";
      }
    }
    if (r.io_path != r.path) f.msg += "; temporary '" + r.io_path + "'";
    return f;
  }

  void open_files(Request& r, uintptr_t addr) {
    const char* p = r.io_path.c_str();
    if (r.write) {
      int flags = O_WRONLY | O_CREAT | O_CLOEXEC | (r.atomic ? O_TRUNC : 0);
      r.fd_buffered = ::open(p, flags, 0644);
      if (r.fd_buffered < 0) throw open_failure(errno, r, "writing");
    } else {
      r.fd_buffered = ::open(p, O_RDONLY | O_CLOEXEC);
      if (r.fd_buffered < 0) throw open_failure(errno, r, "reading");
      struct stat st;
      if (::fstat(r.fd_buffered, &st) != 0) throw open_failure(errno, r, "reading");
      long long end = r.offset + static_cast<long long>(r.nbytes);
      if (S_ISREG(st.st_mode) && r.nbytes > 0 && end > st.st_size) {
        Failure f;
        f.eof = true;
        f.path = r.path;
        f.msg = "short read from '" + r.path + "': cannot read " + std::to_string(r.nbytes) +
                " bytes at offset " + std::to_string(r.offset) + ", the file has only " +
                std::to_string(st.st_size) + " bytes";
        throw f;
      }
    }
    // Direct I/O only pays when whole pages line up between buffer and file.
    bool lines_up = (addr - static_cast<uintptr_t>(r.offset)) % kAlign == 0;
    size_t head = (kAlign - r.offset % kAlign) % kAlign;
    if (lines_up && r.nbytes >= head + kAlign) {
      r.fd_direct = ::open(p, (r.write ? O_WRONLY : O_RDONLY) | O_DIRECT | O_CLOEXEC);
      // EINVAL: the file system has no O_DIRECT (older tmpfs); stay buffered.
    }
    // Direct writes past end of file are synchronous on ext4 (the size must
    // change first); set the final size up front so they overlap. A failed
    // write shrinks the file back (finish()).
    if (r.write && r.fd_direct >= 0) {
      struct stat st;
      long long end = r.offset + static_cast<long long>(r.nbytes);
      if (::fstat(r.fd_buffered, &st) == 0 && S_ISREG(st.st_mode) && end > st.st_size) {
        if (::ftruncate(r.fd_buffered, end) != 0) throw open_failure(errno, r, "writing (extending)");
        r.grown_from = st.st_size;
        r.grown_to = end;
      }
    }
  }

  const size_t block_size_;
  const int queue_depth_, thread_count_;
  const bool single_submit_, overlap_events_;
  std::vector<std::unique_ptr<Worker>> workers_;
  std::mutex submit_mu_;
  size_t next_worker_ = 0;

  std::mutex mu_;
  std::condition_variable cv_;
  int inflight_ = 0;
  int completed_ = 0;
  std::vector<Failure> failures_;
  int inject_errno_ = 0;
  size_t inject_after_ = 0;
  std::atomic<bool> broken_{false};
};

void Worker::loop() {
  for (;;) {
    int staged = 0;
    while (inflight_ < depth_) {  // once broken, next_block() only retires parts
      Block* b = next_block();
      if (b == nullptr) break;
      engine_->prepare(b);
      ++inflight_;
      if (single_submit_) engine_->submit(); else ++staged;
    }
    if (staged > 0) engine_->submit();
    if (inflight_ == 0) {
      std::unique_lock<std::mutex> g(mu_);
      cv_.wait(g, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty() && active_.empty()) return;
      continue;
    }
    int n = engine_->reap(overlap_ ? 1 : inflight_, done_.data(), depth_);
    for (int i = 0; i < n; ++i) complete(done_[i]);
    if (engine_->poisoned() && !broken_) fail_everything(EIO);
  }
}

Block* Worker::next_block() {
  for (;;) {
    if (active_.empty()) {
      std::lock_guard<std::mutex> g(mu_);
      if (queue_.empty()) return nullptr;
      active_.insert(active_.end(), queue_.begin(), queue_.end());
      queue_.clear();
    }
    Part* p = active_.front();
    if (p->req->failed.load() || broken_) {  // stop cutting a failed request
      active_.pop_front();
      p->all_cut = true;
      part_done_maybe(p);
      continue;
    }
    Segment& s = p->seg[p->cur];
    size_t len = std::min(block_size_, s.len - p->cursor);
    int slot = free_.back();
    free_.pop_back();
    busy_[slot] = 1;
    Block* b = &slots_[slot];
    b->fd = s.fd;
    b->write = p->req->write;
    b->buf = s.buf + p->cursor;
    b->len = len;
    b->off = static_cast<off_t>(s.off + static_cast<long long>(p->cursor));
    b->result = 0;
    b->part = p;
    p->cursor += len;
    if (p->cursor == s.len) {
      ++p->cur;
      p->cursor = 0;
    }
    ++p->outstanding;
    if (p->cur == p->nseg) {
      p->all_cut = true;
      active_.pop_front();
    }
    return b;
  }
}

void Worker::complete(Block* b) {
  Part* p = b->part;
  Request* r = p->req.get();
  long res = b->result;
  if (r->inject_errno != 0 && res >= 0 &&
      static_cast<size_t>(b->off - r->offset) + b->len > r->inject_after)
    res = -r->inject_errno;
  if (res >= 0 && static_cast<size_t>(res) < b->len) {
    // A short transfer: finish it synchronously through the buffered
    // descriptor (the remainder need not be aligned). Reads stop at EOF.
    size_t done = static_cast<size_t>(res);
    while (done < b->len) {
      ssize_t k = b->write
          ? ::pwrite(r->fd_buffered, b->buf + done, b->len - done, b->off + done)
          : ::pread(r->fd_buffered, b->buf + done, b->len - done, b->off + done);
      if (k < 0 && errno == EINTR) continue;
      if (k < 0) { res = -errno; break; }
      if (k == 0) { res = b->write ? -EIO : static_cast<long>(done); break; }
      done += static_cast<size_t>(k);
      res = static_cast<long>(done);
    }
  }
  if (res < 0)
    r->fail(static_cast<int>(-res), describe(b->write, b->len, b->off));
  else if (static_cast<size_t>(res) < b->len)
    r->fail_eof(static_cast<size_t>(res), b->len, b->off);
  busy_[b->slot] = 0;
  free_.push_back(b->slot);
  --inflight_;
  --p->outstanding;
  part_done_maybe(p);
}

void Worker::part_done_maybe(Part* p) {
  if (!p->all_cut || p->outstanding > 0) return;
  std::shared_ptr<Request> req = std::move(p->req);
  delete p;
  if (req->parts_left.fetch_sub(1) == 1) handle_->finish(req.get());
}

// The engine can no longer be trusted to report the blocks it holds: fail
// them and everything queued, and refuse new work (buffers stay referenced on
// the Python side, so a late kernel write cannot hit freed memory).
void Worker::fail_everything(int err) {
  broken_ = true;
  handle_->set_broken();
  for (int i = 0; i < depth_; ++i) {
    if (!busy_[i]) continue;
    slots_[i].result = -err;
    complete(&slots_[i]);
  }
}

[[noreturn]] void raise_failure(const Failure& f) {
  if (f.eof) {
    PyErr_SetString(PyExc_EOFError, f.msg.c_str());
    throw py::error_already_set();
  }
  // OSError(errno, msg, filename) picks the subclass (FileNotFoundError, ...).
  PyObject* exc = PyObject_CallFunction(PyExc_OSError, "iss", f.err, f.msg.c_str(), f.path.c_str());
  if (exc == nullptr) throw py::error_already_set();
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc)), exc);
  Py_DECREF(exc);
  throw py::error_already_set();
}

void submit_py(Handle& h, bool write, uintptr_t addr, size_t nbytes, const std::string& path,
               long long offset, bool atomic, bool fsync) {
  Failure failure;
  bool failed = false;
  {
    py::gil_scoped_release nogil;
    try {
      h.submit(write, addr, nbytes, path, offset, atomic, fsync);
    } catch (const Failure& f) {
      failure = f;
      failed = true;
    }
  }
  if (failed) raise_failure(failure);
}

}  // namespace
}  // namespace zfaio

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using zfaio::Handle;
  m.doc() = "zfunc asynchronous file I/O handle";
  m.attr("backend") = zfaio::backend_name();
  m.attr("alignment") = zfaio::kAlign;
  m.def("probe", &zfaio::probe,
        "Empty string if this back end works on this machine, else the reason.");
  py::class_<Handle>(m, "Handle")
      .def(py::init<size_t, int, int, bool, bool>(), py::arg("block_size"),
           py::arg("queue_depth"), py::arg("thread_count"), py::arg("single_submit"),
           py::arg("overlap_events"))
      .def("pread",
           [](Handle& h, uintptr_t addr, size_t nbytes, const std::string& path, long long offset) {
             zfaio::submit_py(h, false, addr, nbytes, path, offset, false, false);
           },
           py::arg("addr"), py::arg("nbytes"), py::arg("path"), py::arg("offset") = 0,
           "Queue a read of nbytes at file offset into memory at addr. The caller keeps "
           "the memory alive until wait() returns.")
      .def("pwrite",
           [](Handle& h, uintptr_t addr, size_t nbytes, const std::string& path, long long offset,
              bool atomic, bool fsync) {
             zfaio::submit_py(h, true, addr, nbytes, path, offset, atomic, fsync);
           },
           py::arg("addr"), py::arg("nbytes"), py::arg("path"), py::arg("offset") = 0,
           py::arg("atomic") = false, py::arg("fsync") = false,
           "Queue a write. atomic=True writes path + '.partial', fsyncs and renames it "
           "to path when every block succeeded, and removes it otherwise.")
      .def("wait",
           [](Handle& h) {
             int n = 0;
             zfaio::Failure failure;
             bool failed = false;
             {
               py::gil_scoped_release nogil;
               try {
                 n = h.wait();
               } catch (const zfaio::Failure& f) {
                 failure = f;
                 failed = true;
               }
             }
             if (failed) zfaio::raise_failure(failure);
             return n;
           },
           "Wait for every request in flight; return how many finished since the last "
           "wait(). Raises OSError/EOFError (naming file, offset and cause) if any failed.")
      .def("poll", &Handle::poll, "Number of requests still in flight (never blocks).")
      .def("broken", &Handle::broken)
      .def("_inject_error", &Handle::inject_error, py::arg("errno"), py::arg("after_bytes") = 0,
           "Make the next request fail with errno once after_bytes of it are done.")
      .def_property_readonly("block_size", &Handle::block_size)
      .def_property_readonly("queue_depth", &Handle::queue_depth)
      .def_property_readonly("thread_count", &Handle::thread_count)
      .def_property_readonly("single_submit", &Handle::single_submit)
      .def_property_readonly("overlap_events", &Handle::overlap_events);
}
