// Per-thread working memory of a kernel call, shared by CompressedAttention (fastcar_ops.cc) and
// GroupQueryAttention (group_query_attention.h).
//
// Why: a decode step should allocate nothing, so each kernel keeps its buffers between calls; thread_local, so
// concurrent Run calls of one session (each computes on its own calling thread; ORT's pool workers only read or
// write through the pointers while that thread waits in ParallelFor) never share them; and a buffer larger than
// kKeepScratchBytes (a long prompt's copies) is freed after its call, so one prompt does not pin megabytes for
// the thread's lifetime.
#pragma once

#include <cstddef>
#include <vector>

namespace fastcar_scratch {

constexpr size_t kKeepScratchBytes = size_t{1} << 20;

// Free b when it holds more than kKeepScratchBytes (a Bufs::Trim helper).
template <class T>
void TrimBuffer(std::vector<T>& b) {
  if (b.capacity() * sizeof(T) > kKeepScratchBytes) std::vector<T>().swap(b);
}

// This thread's Bufs (a struct of buffers with a Trim() member) for one call; Trim on the way out, exceptions
// included.
template <class Bufs>
struct Lease {
  Bufs& s = Mine();
  Lease() = default;
  Lease(const Lease&) = delete;
  Lease& operator=(const Lease&) = delete;
  ~Lease() { s.Trim(); }
  static Bufs& Mine() {
    static thread_local Bufs bufs;
    return bufs;
  }
};

}  // namespace fastcar_scratch
