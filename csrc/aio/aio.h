// Asynchronous file I/O for NVMe swapping: the pieces shared by the handle
// (aio_handle.cpp) and the back ends (engine_uring.cpp, engine_libaio.cpp,
// engine_threads.cpp). Each compiled module links the handle with exactly one
// back end, so every back end that builds can be selected and tested alone.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace zfaio {

// O_DIRECT needs buffer address, length and file offset aligned to the
// device's logical block size; 4096 covers every device we expect.
constexpr size_t kAlign = 4096;

struct Part;  // a worker's share of one request (aio_handle.cpp)

// One contiguous transfer against one file descriptor.
struct Block {
  int fd = -1;
  bool write = false;
  char* buf = nullptr;
  size_t len = 0;
  off_t off = 0;
  long result = 0;        // set by the engine: bytes moved, or -errno
  Part* part = nullptr;   // owner, for completion accounting
  int slot = 0;           // index in the worker's block pool (engines may use it)
};

// A queue of at most `depth` blocks in flight against the kernel.
// prepare() stages a block, submit() hands every staged block over, reap()
// returns finished ones. No method throws once the engine is constructed: a
// block the kernel refuses comes back from reap() with result = -errno.
class Engine {
 public:
  virtual ~Engine() = default;
  virtual void prepare(Block* b) = 0;
  virtual void submit() = 0;
  // Block until at least `min_complete` blocks are done (fewer only if fewer
  // are outstanding); write up to `max` of them to `out`; return how many.
  virtual int reap(int min_complete, Block** out, int max) = 0;
  // True if the kernel may still touch buffers this engine gave up on (a
  // submission failed after the kernel had seen the entries). The handle then
  // refuses new work and the Python side keeps those buffers alive.
  virtual bool poisoned() const { return false; }
};

// Defined once per back end.
std::unique_ptr<Engine> make_engine(int queue_depth);  // throws std::system_error
const char* backend_name();
// Empty if the back end works here (e.g. io_uring is not blocked by seccomp),
// otherwise why not.
std::string probe();

}  // namespace zfaio
