/*!
 * \file collective.h
 * \brief The collective layer's vocabulary: what a collective is (kind, reduce op, dtype,
 *        buffers), the asynchronous Work handle, and the Backend interface that the MPI
 *        (host tensors) and NCCL (CUDA tensors) backends implement.
 *
 * Size rules shared by every backend (N = group size):
 *  - allreduce: send and recv have the same element count; send may alias recv.
 *  - reduce_scatter: recv holds C = ceil(S / N) elements of an S-element send. Rank r receives
 *    the reduction of send[r*C, min((r+1)*C, S)); the rest of recv is zero-filled. This is the
 *    flat, padded dim-0 shard of DESIGN.md section 3 without materialising the padding.
 *  - allgather: send holds C = ceil(R / N) elements of an R-element recv; recv is the
 *    concatenation of every rank's shard truncated to R (so padding never reaches the user).
 *  - Several tensors in one call (ZeRO's buckets, `parts`): a reduce_scatter of full tensors
 *    t_1..t_k leaves in recv this rank's shard of t_1 (C_1 = ceil(n_1 / N) elements, as
 *    above), then of t_2, and so on; an allgather of such a shard buffer writes every full
 *    tensor t_i in place. Each tensor is exchanged where it lives: no packed copy of the
 *    bucket exists on either side. One tensor is exactly the single-tensor form.
 *  - alltoall: without splits, send and recv have the same element count S, a multiple of N;
 *    block j (S / N elements) of send goes to rank j, and block j of recv comes from rank j.
 *    With splits (alltoallv): send_splits[j] elements go to rank j, back to back in send, and
 *    recv_splits[j] come from rank j, back to back in recv; rank i's send_splits[j] must equal
 *    rank j's recv_splits[i] (checked under RAF_DIST_CHECK_COLLECTIVES). Not in place.
 */
#ifndef RAF_DIST_CCL_COLLECTIVE_H_
#define RAF_DIST_CCL_COLLECTIVE_H_

#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace raf_dist {
namespace ccl {

namespace ffi = tvm::ffi;

enum class CollectiveKind : int {
  kAllReduce = 0,
  kReduceScatter,
  kAllGather,
  kBroadcast,
  kSend,
  kRecv,
  kBarrier,
  kAllToAll,
  kNumKinds
};
const char* KindName(CollectiveKind kind);

enum class ReduceOp : int { kSum = 0, kAvg, kMax, kMin };
ReduceOp ParseReduceOp(const std::string& name);
const char* ReduceOpName(ReduceOp op);

/*! \brief The element types a collective accepts. */
enum class ElemType : int { kF16 = 0, kBF16, kF32, kF64, kI32, kI64 };
/*! \brief Map a DLPack dtype to ElemType, raising TypeError naming the supported set. */
ElemType ToElemType(DLDataType dtype, const char* what);
const char* ElemTypeName(ElemType t);
size_t ElemSize(ElemType t);

/*! \brief Element count of a tensor that must be contiguous (raises otherwise). */
int64_t ContiguousNumel(const ffi::Tensor& t, const char* what);
/*! \brief Data pointer including the byte offset. */
inline void* DataPtr(const ffi::Tensor& t) {
  return static_cast<char*>(t.data_ptr()) + t.byte_offset();
}

/*! \brief One collective call, fully validated, ready for a backend to run. */
struct CollectiveCall {
  CollectiveKind kind;
  ReduceOp op = ReduceOp::kSum;
  ElemType elem = ElemType::kF32;  // barrier has no tensors
  ffi::Tensor send;        // undefined for barrier and recv
  ffi::Tensor recv;        // undefined for barrier and send
  int64_t send_count = 0;  // elements
  int64_t recv_count = 0;  // elements
  // reduce_scatter of several full tensors (send undefined) or allgather into several full
  // tensors (recv undefined); the counts above are then their total elements and the shards'
  std::vector<ffi::Tensor> parts;
  int peer = 0;            // root for broadcast, peer for send/recv
  // alltoall: elements sent to / received from each rank (empty: equal blocks)
  std::vector<int64_t> send_splits;
  std::vector<int64_t> recv_splits;
};

/*! \brief Seconds a wait may block before raising; RAF_DIST_COLLECTIVE_TIMEOUT_S, 0 = none. */
double WaitTimeoutSeconds();
/*! \brief Set the wait timeout (seconds; <= 0: none), before the first group is made. */
void SetWaitTimeoutSeconds(double seconds);
/*! \brief The error of a wait that timed out: the call, the limit, the flight recorder. */
std::string TimeoutMessage(const CollectiveCall& call, double timeout);

/*!
 * \brief Marks this process's collectives as broken, for good: a wait that timed out (a peer
 *        is dead or stuck) or a failure this rank reported (``raf_dist.ccl.abort``, called
 *        when an exception escapes a step). Later collectives raise naming ``reason``, and
 *        shutdown neither waits on pending work nor joins a communication thread that may be
 *        stuck in MPI (the process would hang at exit). The first reason is kept.
 */
void MarkBroken(const std::string& reason);
/*! \brief Whether MarkBroken was called; ``reason`` (optional) receives its first reason. */
bool IsBroken(std::string* reason = nullptr);

/*!
 * \brief The flight recorder: the last collectives this process started (group, sequence
 *        number, kind, elements, bytes, age), as PyTorch's NCCL flight recorder keeps them, so
 *        a timeout's error names the call that is stuck and what came before it.
 *        Process-wide, thread safe, a fixed ring of kFlightRecords entries.
 */
constexpr int kFlightRecords = 16;
void RecordFlight(int64_t group, int group_size, int64_t sequence, const CollectiveCall& call);
/*! \brief The recorded calls, oldest first, one per line ("" when none). */
std::string RecentFlights();

/*!
 * \brief Completion state of an asynchronous collective. The call's tensors are held here,
 *        so their memory outlives the collective whatever the caller does meanwhile.
 */
class Work {
 public:
  explicit Work(CollectiveCall call) : call_(std::move(call)) {}
  virtual ~Work() = default;
  /*! \brief Mark finished (error empty on success); wakes waiters. */
  void Finish(std::string error);
  /*! \brief Block until finished; raise RuntimeError if the collective failed. */
  virtual void Wait();
  const CollectiveCall& call() const { return call_; }

 protected:
  CollectiveCall call_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::string error_;
};

/*! \brief A transport for one process group. Implementations are not thread safe: the
 *         Group serialises calls into them. */
class Backend {
 public:
  virtual ~Backend() = default;
  /*! \brief Enqueue the call; the returned Work completes when it has run. */
  virtual std::shared_ptr<Work> Start(CollectiveCall call) = 0;
  /*! \brief Run the call to completion (as the caller sees it). */
  virtual void RunBlocking(CollectiveCall call) { Start(std::move(call))->Wait(); }
};

/*! \brief Shard size for the padded flat sharding: ceil(total / world). */
inline int64_t ShardCount(int64_t total, int world) { return (total + world - 1) / world; }
/*! \brief Valid elements of rank r's shard (the rest is padding). */
inline int64_t ValidCount(int64_t total, int64_t shard, int r) {
  int64_t begin = shard * r;
  if (begin >= total) return 0;
  return std::min<int64_t>(shard, total - begin);
}

/*!
 * \brief Tensor t_i of a bucket t_1..t_k as rank r of N holds it in the padded flat sharding
 *        (the file comment's multi-tensor form): its shard's place in the shard buffer and
 *        which of its elements fill that shard. Produced by ForEachShard, the one place that
 *        walks a bucket's shards.
 */
struct TensorShard {
  size_t index;    // i: the tensor's position in the bucket
  int64_t numel;   // n_i: elements of the full tensor
  int64_t shard;   // C_i = ShardCount(n_i, N): every rank's shard of it, padding included
  int64_t offset;  // C_1 + ... + C_{i-1}: where t_i's shard starts in the shard buffer
  int64_t begin;   // rank r's first element of t_i: min(r * C_i, n_i)
  int64_t valid;   // ValidCount(n_i, C_i, r) elements from `begin`; C_i - valid padding follow
  bool even;       // N * C_i == n_i: no rank's shard of t_i has padding
};

/*!
 * \brief Call fn(t_i, shard) for every tensor of the bucket, in order, with `shard` the
 *        TensorShard of t_i on rank `rank` of `world`. Returns the shard buffer's element
 *        count, sum_i C_i (the same on every rank).
 */
template <typename Fn>
int64_t ForEachShard(const std::vector<ffi::Tensor>& tensors, int world, int rank, Fn&& fn) {
  int64_t offset = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    TensorShard s;
    s.index = i;
    s.numel = tensors[i].numel();
    s.shard = ShardCount(s.numel, world);
    s.offset = offset;
    s.begin = std::min<int64_t>(s.numel, s.shard * rank);
    s.valid = ValidCount(s.numel, s.shard, rank);
    s.even = s.shard * world == s.numel;
    fn(tensors[i], static_cast<const TensorShard&>(s));
    offset += s.shard;
  }
  return offset;
}
/*! \brief Elements of a bucket's shard buffer: sum_i ceil(n_i / world). */
inline int64_t ShardBufferCount(const std::vector<ffi::Tensor>& tensors, int world) {
  return ForEachShard(tensors, world, 0, [](const ffi::Tensor&, const TensorShard&) {});
}

/*! \brief The full tensors of a reduce_scatter (inputs) or allgather (outputs): `parts`, or
 *         the one send / recv. */
inline std::vector<ffi::Tensor> FullTensors(const CollectiveCall& c) {
  if (!c.parts.empty()) return c.parts;
  return {c.kind == CollectiveKind::kReduceScatter ? c.send : c.recv};
}
/*! \brief The shard buffer of a reduce_scatter (its output) or allgather (its input). */
inline const ffi::Tensor& ShardTensor(const CollectiveCall& c) {
  return c.kind == CollectiveKind::kReduceScatter ? c.recv : c.send;
}

}  // namespace ccl
}  // namespace raf_dist

#endif  // RAF_DIST_CCL_COLLECTIVE_H_
