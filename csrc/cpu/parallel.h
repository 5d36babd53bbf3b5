// Work sharing for the CPU kernels: chunks handed out one at a time from a shared counter, run on the
// extension's own pool of worker threads.
//
// at::parallel_for gives each thread a fixed share up front. On a machine whose cores are shared with
// the server's own threads and its clients, a thread that the OS sets aside for a few milliseconds then
// holds up the whole call while the other threads wait. Here a thread that runs takes the next chunk,
// so the call ends when the work does. Which thread computes a chunk never changes what it computes:
// the kernels' results stay independent of the thread count and the schedule.
//
// Why a pool of its own rather than OpenMP's: a decode step makes a few hundred short calls, tens of
// microseconds apart, so what a call costs to start decides the step's time. libgomp's workers spin
// between calls only while it counts no more threads than CPUs, and it counts every thread that ever
// started a parallel region: the server's engine runs on a thread of its own besides the main one, so
// on two cores its workers slept between calls and every call waited for a futex wake-up (SmolLM2 bf16
// decode through the server 19.5 ms a token against 14.4 on the main thread of a script, Intel Xeon,
// 2026-12-06), and under OMP_WAIT_POLICY=PASSIVE they never spin. The pool's workers spin for a while
// after each call (KVSERVE_CPU_SPIN_US, default 300 microseconds: the gaps inside a step), then sleep
// until the next, whatever OpenMP's policy. The pool serves the threads where libgomp's workers would
// sleep (pool::preferred); set_pool(false) (tests, benchmarks) goes back to at::parallel_for.
#pragma once

#include <ATen/Parallel.h>
#include <strings.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace kvserve_cpu {
namespace pool {

inline void cpu_relax() {
#if defined(__x86_64__)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

// How long an idle worker spins before it sleeps (KVSERVE_CPU_SPIN_US, microseconds; 0: never spins).
inline std::chrono::nanoseconds spin_time() {
  static const std::chrono::nanoseconds t = [] {
    const char* s = std::getenv("KVSERVE_CPU_SPIN_US");
    return std::chrono::microseconds(s ? std::max(0L, std::atol(s)) : 300L);
  }();
  return t;
}

inline std::atomic<bool> enabled{true};  // set_pool: false runs the calls through at::parallel_for

// Whether this thread's calls go to the pool: where libgomp's workers would sleep between calls (a
// thread other than the process's main one, or OMP_WAIT_POLICY=PASSIVE). On the main thread under
// OpenMP's default policy libgomp spins between calls itself, and its workers, spinning after torch's
// own ops, would take the cores from the pool's: there the pool made Qwen's 1,800-token prefill in
// process 1.07 -> 1.17 s, so that thread keeps at::parallel_for.
inline bool preferred() {
  static const bool passive = [] {
    const char* s = std::getenv("OMP_WAIT_POLICY");
    return s != nullptr && strcasecmp(s, "passive") == 0;
  }();
  static thread_local const bool main_thread = syscall(SYS_gettid) == getpid();
  return passive || !main_thread;
}
inline thread_local bool in_call = false;  // inside a body: a nested call runs inline, on this thread

// Worker threads that run one body at a time: the caller is one worker, the pool's threads the others.
class Pool {
 public:
  // Runs body() on `workers` threads and returns when every one has returned (rethrowing the first
  // exception any of them raised). A nested call, or one made while another thread's call holds the
  // pool, runs body() on the caller alone: the bodies take chunks from a shared counter, so one worker
  // does all of them.
  void run(int workers, const std::function<void()>& body) {
    std::unique_lock<std::mutex> busy(run_mutex_, std::defer_lock);
    if (workers <= 1 || in_call || !busy.try_lock()) {
      body();
      return;
    }
    grow(workers - 1);
    body_ = &body;
    error_ = nullptr;
    pending_.store(workers - 1, std::memory_order_relaxed);
    const uint64_t next = (job_.load(std::memory_order_relaxed) >> 16) + 1;
    job_.store(next << 16 | static_cast<uint64_t>(workers - 1), std::memory_order_seq_cst);  // publishes it
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lock(sleep_mutex_);
      wake_.notify_all();
    }
    in_call = true;
    std::exception_ptr own;
    try {
      body();
    } catch (...) {
      own = std::current_exception();
    }
    in_call = false;
    while (pending_.load(std::memory_order_acquire) > 0) cpu_relax();  // the helpers read body_: wait for them
    if (own) std::rethrow_exception(own);
    if (error_) std::rethrow_exception(error_);
  }

 private:
  void grow(int n) {
    const uint64_t now = job_.load(std::memory_order_relaxed);  // a new thread runs the jobs after this one
    for (; threads_ < n; ++threads_) std::thread(&Pool::loop, this, threads_, now).detach();  // never joined
  }

  void loop(int index, uint64_t seen) {
    in_call = true;
    for (;;) {
      uint64_t job;
      auto since = std::chrono::steady_clock::now();
      for (int n = 1; (job = job_.load(std::memory_order_acquire)) == seen; ++n) {
        cpu_relax();
        if (n % 256 || std::chrono::steady_clock::now() - since < spin_time()) continue;
        std::unique_lock<std::mutex> lock(sleep_mutex_);
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        wake_.wait(lock, [&] { return job_.load(std::memory_order_seq_cst) != seen; });
        sleepers_.fetch_sub(1, std::memory_order_relaxed);
        since = std::chrono::steady_clock::now();
      }
      seen = job;
      if (index >= static_cast<int>(job & 0xffff)) continue;  // a job of fewer workers than the pool has
      try {
        (*body_)();
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mutex_);
        if (!error_) error_ = std::current_exception();
      }
      pending_.fetch_sub(1, std::memory_order_release);
    }
  }

  std::mutex run_mutex_;  // one call at a time
  int threads_ = 0;
  // The job: its number (high bits) and how many of the pool's threads run it (low 16 bits), in one word
  // so that a worker reads both at once; body_ is written before and read only by those threads, and
  // the caller waits for them before the next job writes it.
  std::atomic<uint64_t> job_{0};
  const std::function<void()>* body_ = nullptr;
  std::atomic<int> pending_{0};  // helpers still running the job
  std::atomic<int> sleepers_{0};
  std::mutex sleep_mutex_;
  std::condition_variable wake_;
  std::mutex error_mutex_;
  std::exception_ptr error_;
};

// The process's pool (a forked child starts one of its own: its parent's threads are not in it).
inline Pool& instance() {
  static std::mutex m;
  static Pool* pool = nullptr;
  static pid_t owner = 0;
  std::lock_guard<std::mutex> lock(m);
  if (pool == nullptr || owner != getpid()) pool = new Pool(), owner = getpid();  // never destroyed
  return *pool;
}

}  // namespace pool

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
  if (pool::enabled.load(std::memory_order_relaxed) && pool::preferred()) {
    pool::instance().run(static_cast<int>(workers), worker);
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
