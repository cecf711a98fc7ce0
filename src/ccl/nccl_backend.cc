/*!
 * \file nccl_backend.cc
 * \brief CUDA-tensor collectives over NCCL (built when USE_NCCL). Every collective runs on a
 *        dedicated communication stream: start records an event on the compute stream and
 *        makes the communication stream wait for it; wait makes the compute stream wait for
 *        the collective's completion event. Neither blocks the host.
 *
 * The NCCL unique id travels over MPI (the group's bootstrap communicator).
 *
 * Failures: a NCCL collective whose peer died never completes, and the host only notices
 * when it next synchronises (forever). As PyTorch's ProcessGroupNCCL watchdog does, a thread
 * per backend polls every collective in flight (its completion event) and the communicator's
 * asynchronous error (ncclCommGetAsyncError); a collective older than
 * RAF_DIST_COLLECTIVE_TIMEOUT_S, or an asynchronous error, marks the process broken (later
 * collectives raise naming it, the flight recorder included) and aborts the communicator
 * (ncclCommAbort), which ends the kernels waiting for the dead peer so the host can raise
 * instead of hanging. Destruction after a failure aborts rather than destroys (ncclCommDestroy
 * would wait for the dead peer too).
 */
#include <cuda_runtime.h>
#include <nccl.h>
#include <tvm/ffi/extra/c_env_api.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <sstream>
#include <thread>

#include "group.h"

namespace raf_dist {
namespace ccl {
namespace {

void CheckCuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    TVM_FFI_THROW(RuntimeError) << "CUDA " << what << " failed: " << cudaGetErrorString(err);
  }
}

void CheckNccl(ncclResult_t res, const char* what) {
  if (res != ncclSuccess) {
    TVM_FFI_THROW(RuntimeError) << "NCCL " << what << " failed: " << ncclGetErrorString(res);
  }
}

ncclDataType_t ToNcclType(ElemType t) {
  switch (t) {
    case ElemType::kF16:
      return ncclHalf;
    case ElemType::kBF16:
      return ncclBfloat16;
    case ElemType::kF32:
      return ncclFloat;
    case ElemType::kF64:
      return ncclDouble;
    case ElemType::kI32:
      return ncclInt32;
    case ElemType::kI64:
      return ncclInt64;
  }
  return ncclFloat;
}

ncclRedOp_t ToNcclOp(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return ncclSum;
    case ReduceOp::kAvg:
      return ncclAvg;
    case ReduceOp::kMax:
      return ncclMax;
    case ReduceOp::kMin:
      return ncclMin;
  }
  return ncclSum;
}

cudaStream_t ComputeStream(int device) {
  return static_cast<cudaStream_t>(TVMFFIEnvGetStream(kDLCUDA, device));
}

/*! \brief Completion is an event on the communication stream; waiting is stream-ordered. */
class NcclWork : public Work {
 public:
  NcclWork(CollectiveCall call, int device, cudaEvent_t done)
      : Work(std::move(call)), device_(device), done_event_(done) {}
  ~NcclWork() override { cudaEventDestroy(done_event_); }
  void Wait() override {
    CheckCuda(cudaSetDevice(device_), "SetDevice");
    CheckCuda(cudaStreamWaitEvent(ComputeStream(device_), done_event_, 0), "StreamWaitEvent");
    Finish("");
  }

 private:
  int device_;
  cudaEvent_t done_event_;
};

class NcclBackend : public Backend {
 public:
  NcclBackend(MPI_Comm bootstrap, int device) : device_(device) {
    MPI_Comm_rank(bootstrap, &rank_);
    MPI_Comm_size(bootstrap, &size_);
    ncclUniqueId id;
    if (rank_ == 0) CheckNccl(ncclGetUniqueId(&id), "GetUniqueId");
    MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, bootstrap);
    CheckCuda(cudaSetDevice(device_), "SetDevice");
    CheckNccl(ncclCommInitRank(&comm_, size_, id, rank_), "CommInitRank");
    CheckCuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "StreamCreate");
    monitor_ = std::thread([this] { Monitor(); });
  }
  ~NcclBackend() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    if (monitor_.joinable()) monitor_.join();
    cudaSetDevice(device_);
    if (aborted_.load()) {
      // ncclCommAbort already ended the communicator; the stream may hold dead kernels' events
    } else if (IsBroken()) {
      ncclCommAbort(comm_);  // a peer is gone: destroying would wait for it
    } else {
      cudaStreamSynchronize(stream_);
      ncclCommDestroy(comm_);
    }
    cudaStreamDestroy(stream_);
    for (auto& f : in_flight_) cudaEventDestroy(f.event);
  }

  std::shared_ptr<Work> Start(CollectiveCall c) override {
    if (aborted_.load()) {
      std::string reason;
      IsBroken(&reason);
      TVM_FFI_THROW(RuntimeError) << "the NCCL communicator was aborted: " << reason;
    }
    CheckCuda(cudaSetDevice(device_), "SetDevice");
    cudaEvent_t ready, done, watched;
    CheckCuda(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming), "EventCreate");
    CheckCuda(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), "EventCreate");
    CheckCuda(cudaEventCreateWithFlags(&watched, cudaEventDisableTiming), "EventCreate");
    CheckCuda(cudaEventRecord(ready, ComputeStream(device_)), "EventRecord");
    CheckCuda(cudaStreamWaitEvent(stream_, ready, 0), "StreamWaitEvent");
    cudaEventDestroy(ready);
    Enqueue(c);
    CheckCuda(cudaEventRecord(done, stream_), "EventRecord");
    CheckCuda(cudaEventRecord(watched, stream_), "EventRecord");  // the monitor's own copy
    {
      std::lock_guard<std::mutex> lock(mu_);
      in_flight_.push_back({watched, std::chrono::steady_clock::now(), c});
    }
    cv_.notify_all();
    return std::make_shared<NcclWork>(std::move(c), device_, done);
  }

 private:
  struct InFlight {
    cudaEvent_t event;
    std::chrono::steady_clock::time_point start;
    CollectiveCall call;  // keeps the buffers alive until the kernels are done with them
  };

  /*! \brief The watchdog thread (see the file comment). Polls every 100 ms while a
   *         collective is in flight, sleeps otherwise. */
  void Monitor() {
    double timeout = WaitTimeoutSeconds();
    std::unique_lock<std::mutex> lock(mu_);
    while (!stopping_) {
      if (in_flight_.empty()) {
        cv_.wait(lock, [this] { return stopping_ || !in_flight_.empty(); });
        continue;
      }
      cv_.wait_for(lock, std::chrono::milliseconds(100));
      cudaSetDevice(device_);
      while (!in_flight_.empty() && cudaEventQuery(in_flight_.front().event) == cudaSuccess) {
        cudaEventDestroy(in_flight_.front().event);
        in_flight_.pop_front();  // collectives on one stream complete in order
      }
      std::string reason;
      ncclResult_t async_error = ncclSuccess;
      ncclCommGetAsyncError(comm_, &async_error);
      if (async_error != ncclSuccess && async_error != ncclInProgress) {
        reason = std::string("NCCL reported an asynchronous error on rank ") +
                 std::to_string(rank_) + ": " + ncclGetErrorString(async_error) +
                 " (a peer died or the network failed)";
      } else if (timeout > 0 && !in_flight_.empty() &&
                 std::chrono::steady_clock::now() - in_flight_.front().start >
                     std::chrono::duration<double>(timeout)) {
        reason = "NCCL " + TimeoutMessage(in_flight_.front().call, timeout);
      }
      if (!reason.empty()) {
        MarkBroken(reason);
        ncclCommAbort(comm_);  // the kernels waiting for the peer end; the host can raise
        aborted_.store(true);
        return;
      }
    }
  }

  void Enqueue(const CollectiveCall& c) {
    ncclDataType_t dtype = ToNcclType(c.elem);
    size_t esize = ElemSize(c.elem);
    switch (c.kind) {
      case CollectiveKind::kAllReduce:
        CheckNccl(ncclAllReduce(DataPtr(c.send), DataPtr(c.recv), c.recv_count, dtype,
                                ToNcclOp(c.op), comm_, stream_),
                  "AllReduce");
        break;
      case CollectiveKind::kReduceScatter: {
        // one NCCL reduce-scatter per full tensor, each into its place in the shard buffer
        char* recv = static_cast<char*>(DataPtr(c.recv));
        ForEachShard(FullTensors(c), size_, rank_,
                     [&](const ffi::Tensor& t, const TensorShard& s) {
          char* out = recv + s.offset * esize;
          if (s.even) {
            CheckNccl(ncclReduceScatter(DataPtr(t), out, s.shard, dtype, ToNcclOp(c.op), comm_,
                                        stream_),
                      "ReduceScatter");
          } else {  // pad the input with zeros to N whole shards
            void* padded = nullptr;
            size_t bytes = static_cast<size_t>(s.shard) * size_ * esize;
            CheckCuda(cudaMallocAsync(&padded, bytes, stream_), "MallocAsync");
            CheckCuda(cudaMemsetAsync(padded, 0, bytes, stream_), "MemsetAsync");
            CheckCuda(cudaMemcpyAsync(padded, DataPtr(t), s.numel * esize,
                                      cudaMemcpyDeviceToDevice, stream_),
                      "MemcpyAsync");
            CheckNccl(ncclReduceScatter(padded, out, s.shard, dtype, ToNcclOp(c.op), comm_,
                                        stream_),
                      "ReduceScatter");
            CheckCuda(cudaFreeAsync(padded, stream_), "FreeAsync");
          }
        });
        break;
      }
      case CollectiveKind::kAllGather: {
        // one NCCL allgather per full tensor, straight into it when its size divides by N
        const char* send = static_cast<const char*>(DataPtr(c.send));
        ForEachShard(FullTensors(c), size_, rank_,
                     [&](const ffi::Tensor& t, const TensorShard& s) {
          const char* in = send + s.offset * esize;
          if (s.even) {
            CheckNccl(ncclAllGather(in, DataPtr(t), s.shard, dtype, comm_, stream_), "AllGather");
          } else {  // gather N whole shards, keep the first n elements
            void* padded = nullptr;
            CheckCuda(cudaMallocAsync(&padded, static_cast<size_t>(s.shard) * size_ * esize,
                                      stream_),
                      "MallocAsync");
            CheckNccl(ncclAllGather(in, padded, s.shard, dtype, comm_, stream_), "AllGather");
            CheckCuda(cudaMemcpyAsync(DataPtr(t), padded, s.numel * esize,
                                      cudaMemcpyDeviceToDevice, stream_),
                      "MemcpyAsync");
            CheckCuda(cudaFreeAsync(padded, stream_), "FreeAsync");
          }
        });
        break;
      }
      case CollectiveKind::kBroadcast:
        CheckNccl(ncclBroadcast(DataPtr(c.send), DataPtr(c.recv), c.recv_count, dtype, c.peer,
                                comm_, stream_),
                  "Broadcast");
        break;
      case CollectiveKind::kSend:
        CheckNccl(ncclSend(DataPtr(c.send), c.send_count, dtype, c.peer, comm_, stream_), "Send");
        break;
      case CollectiveKind::kRecv:
        CheckNccl(ncclRecv(DataPtr(c.recv), c.recv_count, dtype, c.peer, comm_, stream_), "Recv");
        break;
      case CollectiveKind::kAllToAll: {
        // one send and one receive per rank (itself included) in one NCCL group, as
        // nccl-tests' alltoall does; equal blocks without splits
        const char* send = static_cast<const char*>(DataPtr(c.send));
        char* recv = static_cast<char*>(DataPtr(c.recv));
        size_t send_offset = 0, recv_offset = 0;
        CheckNccl(ncclGroupStart(), "GroupStart");
        struct CloseGroup {  // an error inside must not leave the group open (later calls
          bool open = true;  // would be deferred for ever)
          ~CloseGroup() {
            if (open) ncclGroupEnd();
          }
        } group;
        for (int r = 0; r < size_; ++r) {
          size_t out = c.send_splits.empty() ? c.send_count / size_ : c.send_splits[r];
          size_t in = c.recv_splits.empty() ? c.recv_count / size_ : c.recv_splits[r];
          // empty blocks are skipped on both sides alike (rank i's send count to j is rank
          // j's receive count from i), as PyTorch's uneven alltoall does
          if (out > 0) {
            CheckNccl(ncclSend(send + send_offset * esize, out, dtype, r, comm_, stream_),
                      "Send");
          }
          if (in > 0) {
            CheckNccl(ncclRecv(recv + recv_offset * esize, in, dtype, r, comm_, stream_),
                      "Recv");
          }
          send_offset += out;
          recv_offset += in;
        }
        group.open = false;
        CheckNccl(ncclGroupEnd(), "GroupEnd");
        break;
      }
      default:
        TVM_FFI_THROW(InternalError) << KindName(c.kind) << " has no NCCL form";
    }
  }

  int device_;
  int rank_ = 0;
  int size_ = 1;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<InFlight> in_flight_;
  bool stopping_ = false;
  std::atomic<bool> aborted_{false};
  std::thread monitor_;
};

}  // namespace

std::unique_ptr<Backend> CreateNcclBackend(MPI_Comm comm, int device_id) {
  return std::make_unique<NcclBackend>(comm, device_id);
}

}  // namespace ccl
}  // namespace raf_dist
