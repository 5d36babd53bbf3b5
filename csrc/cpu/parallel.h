// Work sharing for the CPU kernels: chunks handed out one at a time from a shared counter.
//
// at::parallel_for gives each thread a fixed share up front. On a machine whose cores are shared with
// the server's own threads and its clients, a thread that the OS sets aside for a few milliseconds then
// holds up the whole call while the other threads wait. Here a thread that runs takes the next chunk,
// so the call ends when the work does. Which thread computes a chunk never changes what it computes:
// the kernels' results stay independent of the thread count and the schedule.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace kvserve_cpu {

// Calls fn(first, last) over [0, n) in chunks of `chunk` items (the last may be shorter), on at most
// min(torch's threads, ceil(n / min_per_thread)) threads: fewer items than that stay on one thread.
// make_state() builds each worker's scratch once (fn(state, first, last) when given).
template <typename MakeState, typename F>
void parallel_chunks_with(int64_t n, int64_t chunk, int64_t min_per_thread, const MakeState& make_state, const F& fn) {
  if (n <= 0) return;
  chunk = std::max<int64_t>(1, chunk);
  const int64_t num_chunks = (n + chunk - 1) / chunk;
  const int64_t by_work = std::max<int64_t>(1, n / std::max<int64_t>(1, min_per_thread));
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>({at::get_num_threads(), by_work, num_chunks}));
  std::atomic<int64_t> next{0};
  auto worker = [&] {
    auto state = make_state();
    for (int64_t c = next++; c < num_chunks; c = next++) fn(state, c * chunk, std::min(n, (c + 1) * chunk));
  };
  if (workers == 1) {
    worker();
    return;
  }
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) { worker(); });
}

template <typename F>
void parallel_chunks(int64_t n, int64_t chunk, int64_t min_per_thread, const F& fn) {
  parallel_chunks_with(n, chunk, min_per_thread, [] { return 0; },
                       [&](int, int64_t first, int64_t last) { fn(first, last); });
}

}  // namespace kvserve_cpu
