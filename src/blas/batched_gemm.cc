/*!
 * \file batched_gemm.cc
 * \brief Host BLAS on TVM's thread pool: `raf_dist.blas.batched_gemm` (a batch of small
 *        matrix products spread over the pool, each one call of the BLAS's cblas gemm) and
 *        an OpenBLAS threads callback that runs OpenBLAS's own parallel jobs on the pool.
 *
 * One pool for kernels and BLAS. TVM's kernels and OpenBLAS each kept a pool of their own on
 * the same cores: after a GEMM, OpenBLAS's workers spin (up to 2^28 cycles) while TVM's wake
 * from sleep for the next kernel, and the two take turns on a core (measured: a 64 x
 * 64x64x32 batched product split over two threads 0.11 ms alone, 0.19 ms right after a GEMM;
 * the bias add after a GEMM 70 -> 92 us). OpenBLAS >= 0.3.27 lets the application run its
 * jobs (`openblas_set_threads_callback_function`), so they run on TVM's workers, which
 * PyTorch's one OpenMP pool for ATen and MKL also gets by construction.
 *
 * Batches of small products: numpy's matmul runs a stack of matrices one gemm after another
 * on the calling thread, and OpenBLAS runs a gemm of at most 65536 x 4 multiply-adds on one
 * thread, so the attention's per-head products (64 of 64x64x32) used one core of two
 * (0.151 ms; split over two threads 0.094 ms). OpenBLAS 0.3.31's cblas_sgemm_batch and
 * _batch_strided, made for this, crash in the build numpy ships (a null kernel pointer in
 * inner_small_matrix_thread, also on one thread), and a Python thread pool costs more to wake
 * (~0.1 ms) than the split saves. Each task of the pool takes matrices from a shared counter,
 * so a worker that starts late takes fewer.
 *
 * The function addresses (TVM's TVMBackendParallelLaunch, the BLAS's gemm and callback
 * setter) come from Python, which knows which libraries the process loaded.
 */
#include <pthread.h>
#include <unistd.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/reflection/registry.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace raf_dist {
namespace blas {
namespace {

constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;  // the CBLAS enums
// copying B^T costs n x k against the product's m x n x k: worth it from this many rows
constexpr int64_t kMinRowsToCopy = 16;

// cblas_?gemm with the integer width of the library's interface (LP64 or ILP64)
template <typename I, typename T>
using Gemm = void (*)(int, int, int, I, I, I, T, const T*, I, const T*, I, T, T*, I);

// TVM's runtime (c_backend_api.h): runs flambda(task_id, env, cdata) for task_id in
// [0, num_task) on its pool, the calling thread taking task 0; num_task 0 means every thread
struct ParallelGroupEnv {
  void* sync_handle;
  int32_t num_task;
};
using ParallelLambda = int (*)(int task_id, ParallelGroupEnv* env, void* cdata);
using ParallelLaunch = int (*)(ParallelLambda flambda, void* cdata, int num_task);

// The pool TVM made for the thread that called set_num_threads: TVM keeps a pool per thread,
// cannot launch from its own workers, and raises when asked for more tasks than its pool uses
std::atomic<ParallelLaunch> launch{nullptr};
std::atomic<int> pool_threads{1};
std::atomic<std::thread::id> pool_owner{};
pid_t pool_pid = 0;  // the process whose pool it is: a forked child has none of its workers
// set inside a pool task
thread_local bool in_pool_task = false;

// True on the thread that owns TVM's pool, outside its tasks: where a launch may go
bool CanLaunchHere() {
  return launch.load() != nullptr && !in_pool_task &&
         std::this_thread::get_id() == pool_owner.load();
}

// body(own) on this thread while the tasks in [first, end) run on threads of their own
template <typename Body>
void RunBesideThreads(int own, int first, int end, Body& body) {
  std::vector<std::thread> threads;
  for (int task = first; task < end; ++task) {
    threads.emplace_back([&body, task] { body(task); });
  }
  body(own);
  for (std::thread& thread : threads) thread.join();
}

// Runs body(task) for every task in [0, tasks) at once, each on its own thread: on TVM's pool
// from the thread that owns it (outside its tasks), else on threads of its own. The tasks may
// wait on each other, as OpenBLAS's GEMM jobs do, so they never run one after another.
template <typename Body>
void RunConcurrently(int tasks, Body& body) {
  if (tasks <= 1) {
    body(0);
    return;
  }
  if (CanLaunchHere() && tasks <= pool_threads.load()) {
    struct Closure {
      Body* body;
      int tasks;
    } closure{&body, tasks};
    auto lambda = [](int task, ParallelGroupEnv* env, void* cdata) {
      auto* c = static_cast<Closure*>(cdata);
      in_pool_task = true;
      if (task == 0 && env->num_task < c->tasks) {
        // TVM ran fewer tasks than asked (it runs only task 0 while its TVM_NUM_THREADS is 1):
        // the rest on threads of their own, at the same time
        RunBesideThreads(0, env->num_task, c->tasks, *c->body);
      } else {
        (*c->body)(task);
      }
      in_pool_task = false;
      return 0;
    };
    int rc = -1;
    ParallelLaunch pool = launch.load();
    try {
      // TVM's checks throw before any task is queued
      if (pool != nullptr) rc = pool(lambda, &closure, tasks);
    } catch (...) {
    }
    if (rc == 0) return;
  }
  RunBesideThreads(0, 1, tasks, body);
}

// OpenBLAS's openblas_threads_callback: run dojob(i, &jobdata[i], dojob_data) for every job.
// One group at a time: the jobs' scratch is OpenBLAS's global blas_thread_buffer[i], which its
// own server never hands to two groups at once either (level 2 has no lock of its own). An
// exception (no thread could be made) cannot cross OpenBLAS's C frames: noexcept terminates.
using DoJob = void (*)(int thread_num, void* jobdata, int dojob_data);
std::atomic<int64_t> openblas_pool_launches{0};  // for tests: groups that ran on TVM's pool
void OpenblasThreads(int sync, DoJob dojob, int numjobs, size_t jobdata_elsize, void* jobdata,
                     int dojob_data) noexcept {
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  char* jobs = static_cast<char*>(jobdata);
  std::atomic<bool> on_pool{false};
  auto body = [&](int i) {
    if (in_pool_task) on_pool.store(true, std::memory_order_relaxed);
    dojob(i, jobs + i * jobdata_elsize, dojob_data);
  };
  RunConcurrently(numjobs, body);
  if (on_pool.load()) openblas_pool_launches.fetch_add(1, std::memory_order_relaxed);
}

template <typename I, typename T>
void Batched(int64_t fn, int64_t batch, bool trans_a, bool trans_b, int64_t m, int64_t n,
             int64_t k, int64_t a, int64_t lda, int64_t stride_a, int64_t b, int64_t ldb,
             int64_t stride_b, int64_t c, int64_t ldc, int64_t stride_c) {
  auto gemm = reinterpret_cast<Gemm<I, T>>(fn);
  const T* pa = reinterpret_cast<const T*>(a);
  const T* pb = reinterpret_cast<const T*>(b);
  T* pc = reinterpret_cast<T*>(c);
  // A B^T: OpenBLAS's small-matrix path for it ran at half the speed of A B (64 of 64x32 by
  // 32x64: 0.26 vs 0.15 ms); a task copies its B^T into a scratch matrix first (n x k, 8 KB
  // here, against m x n x k multiply-adds)
  bool copy_b = trans_b && !trans_a && m >= kMinRowsToCopy;
  std::atomic<int64_t> next{0};
  auto task = [&](int) {
    std::vector<T> scratch(copy_b ? k * n : 0);
    for (int64_t i = next.fetch_add(1); i < batch; i = next.fetch_add(1)) {
      const T* mb = pb + i * stride_b;
      if (copy_b) {
        for (int64_t row = 0; row < n; ++row) {
          for (int64_t col = 0; col < k; ++col) scratch[col * n + row] = mb[row * ldb + col];
        }
        gemm(kRowMajor, kNoTrans, kNoTrans, m, n, k, T(1), pa + i * stride_a, lda,
             scratch.data(), n, T(0), pc + i * stride_c, ldc);
      } else {
        gemm(kRowMajor, trans_a ? kTrans : kNoTrans, trans_b ? kTrans : kNoTrans, m, n, k, T(1),
             pa + i * stride_a, lda, mb, ldb, T(0), pc + i * stride_c, ldc);
      }
    }
  };
  // on this thread alone without TVM's pool (another thread, a forked child) or inside one of
  // its tasks: the tasks need not run at once, each takes what is left
  RunConcurrently(
      CanLaunchHere() ? static_cast<int>(std::min<int64_t>(pool_threads.load(), batch)) : 1,
      task);
}

using SetThreadsCallback = void (*)(decltype(&OpenblasThreads));

}  // namespace

TVM_FFI_STATIC_INIT_BLOCK() {
  namespace refl = tvm::ffi::reflection;
  refl::GlobalDef()
      // TVM's TVMBackendParallelLaunch and its pool size (set_num_threads), for this thread;
      // false in a forked child of the process that first gave them
      .def("raf_dist.blas.use_pool",
           [](int64_t parallel_launch, int64_t threads) -> bool {
             static std::once_flag once;
             std::call_once(once, [] {
               pool_pid = getpid();
               // a forked child (a data-loader worker) has none of TVM's workers: a launch
               // there would wait for them forever, so its BLAS jobs use threads of their own
               pthread_atfork(nullptr, nullptr, [] { launch.store(nullptr); });
             });
             if (getpid() != pool_pid) return false;  // set_num_threads in a forked child
             pool_threads.store(static_cast<int>(threads));
             pool_owner.store(std::this_thread::get_id());
             launch.store(reinterpret_cast<ParallelLaunch>(parallel_launch));
             return true;
           })
      // how many tasks a launch of `tasks` ran on the pool at once (a check that the pool
      // really has that many threads before OpenBLAS's jobs, which wait on each other, go there)
      .def("raf_dist.blas.pool_tasks",
           [](int64_t tasks) -> int64_t {
             ParallelLaunch pool = launch.load();
             if (pool == nullptr) return 0;
             // [0]: tasks that started, [1]: the group size TVM gave them
             std::atomic<int> counters[2] = {0, 0};
             auto lambda = [](int, ParallelGroupEnv* env, void* cdata) {
               auto* counters = static_cast<std::atomic<int>*>(cdata);
               counters[1].store(env->num_task);
               counters[0].fetch_add(1);
               // wait (bounded) for the others: together, not one after another
               for (int spin = 0; spin < 1000000 && counters[0].load() < env->num_task; ++spin) {
                 std::this_thread::yield();
               }
               return 0;
             };
             if (pool(lambda, counters, static_cast<int>(tasks)) != 0) return 0;
             return std::min(counters[0].load(), counters[1].load());
           })
      // OpenBLAS's openblas_set_threads_callback_function: its jobs on TVM's pool, or (false)
      // back on its own threads
      .def("raf_dist.blas.openblas_on_pool",
           [](int64_t set_callback, bool on) {
             reinterpret_cast<SetThreadsCallback>(set_callback)(on ? &OpenblasThreads : nullptr);
           })
      .def("raf_dist.blas.openblas_pool_launches",
           []() { return openblas_pool_launches.load(); })
      // (fn, ilp64, is_double, batch, trans_a, trans_b, m, n, k, a, lda, stride_a, b, ldb,
      //  stride_b, c, ldc, stride_c): fn a cblas_?gemm, pointers as integers, sizes in elements
      .def_packed("raf_dist.blas.batched_gemm",
                  [](tvm::ffi::PackedArgs args, tvm::ffi::Any* rv) {
                    auto i = [&](int idx) { return args[idx].cast<int64_t>(); };
                    bool ilp64 = args[1].cast<bool>(), is_double = args[2].cast<bool>();
                    auto call = is_double
                                    ? (ilp64 ? Batched<int64_t, double> : Batched<int32_t, double>)
                                    : (ilp64 ? Batched<int64_t, float> : Batched<int32_t, float>);
                    call(i(0), i(3), args[4].cast<bool>(), args[5].cast<bool>(), i(6), i(7), i(8),
                         i(9), i(10), i(11), i(12), i(13), i(14), i(15), i(16), i(17));
                  });
}

}  // namespace blas
}  // namespace raf_dist
