/*!
 * \file nccl_backend.cc
 * \brief CUDA-tensor collectives over NCCL (built when USE_NCCL). Every collective runs on a
 *        dedicated communication stream: start records an event on the compute stream and
 *        makes the communication stream wait for it; wait makes the compute stream wait for
 *        the collective's completion event. Neither blocks the host.
 *
 * The NCCL unique id travels over MPI (the group's bootstrap communicator).
 */
#include <cuda_runtime.h>
#include <nccl.h>
#include <tvm/ffi/extra/c_env_api.h>

#include <mutex>

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
  }
  ~NcclBackend() override {
    cudaSetDevice(device_);
    cudaStreamSynchronize(stream_);
    ncclCommDestroy(comm_);
    cudaStreamDestroy(stream_);
  }

  std::shared_ptr<Work> Start(CollectiveCall c) override {
    CheckCuda(cudaSetDevice(device_), "SetDevice");
    cudaEvent_t ready, done;
    CheckCuda(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming), "EventCreate");
    CheckCuda(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), "EventCreate");
    CheckCuda(cudaEventRecord(ready, ComputeStream(device_)), "EventRecord");
    CheckCuda(cudaStreamWaitEvent(stream_, ready, 0), "StreamWaitEvent");
    cudaEventDestroy(ready);
    Enqueue(c);
    CheckCuda(cudaEventRecord(done, stream_), "EventRecord");
    return std::make_shared<NcclWork>(std::move(c), device_, done);
  }

 private:
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
        int64_t shard = c.recv_count;
        if (shard * size_ == c.send_count) {
          CheckNccl(ncclReduceScatter(DataPtr(c.send), DataPtr(c.recv), shard, dtype,
                                      ToNcclOp(c.op), comm_, stream_),
                    "ReduceScatter");
        } else {  // pad the input with zeros to N whole shards
          void* padded = nullptr;
          size_t bytes = static_cast<size_t>(shard) * size_ * esize;
          CheckCuda(cudaMallocAsync(&padded, bytes, stream_), "MallocAsync");
          CheckCuda(cudaMemsetAsync(padded, 0, bytes, stream_), "MemsetAsync");
          CheckCuda(cudaMemcpyAsync(padded, DataPtr(c.send), c.send_count * esize,
                                    cudaMemcpyDeviceToDevice, stream_),
                    "MemcpyAsync");
          CheckNccl(ncclReduceScatter(padded, DataPtr(c.recv), shard, dtype, ToNcclOp(c.op),
                                      comm_, stream_),
                    "ReduceScatter");
          CheckCuda(cudaFreeAsync(padded, stream_), "FreeAsync");
        }
        break;
      }
      case CollectiveKind::kAllGather: {
        int64_t shard = c.send_count;
        if (shard * size_ == c.recv_count) {
          CheckNccl(ncclAllGather(DataPtr(c.send), DataPtr(c.recv), shard, dtype, comm_, stream_),
                    "AllGather");
        } else {  // gather N whole shards, keep the first R elements
          void* padded = nullptr;
          CheckCuda(cudaMallocAsync(&padded, static_cast<size_t>(shard) * size_ * esize, stream_),
                    "MallocAsync");
          CheckNccl(ncclAllGather(DataPtr(c.send), padded, shard, dtype, comm_, stream_),
                    "AllGather");
          CheckCuda(cudaMemcpyAsync(DataPtr(c.recv), padded, c.recv_count * esize,
                                    cudaMemcpyDeviceToDevice, stream_),
                    "MemcpyAsync");
          CheckCuda(cudaFreeAsync(padded, stream_), "FreeAsync");
        }
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
      default:
        TVM_FFI_THROW(InternalError) << KindName(c.kind) << " has no NCCL form";
    }
  }

  int device_;
  int rank_ = 0;
  int size_ = 1;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
};

}  // namespace

std::unique_ptr<Backend> CreateNcclBackend(MPI_Comm comm, int device_id) {
  return std::make_unique<NcclBackend>(comm, device_id);
}

}  // namespace ccl
}  // namespace raf_dist
