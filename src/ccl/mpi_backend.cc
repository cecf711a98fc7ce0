/*!
 * \file mpi_backend.cc
 * \brief MPI transport: a FIFO of calls drained by one communication thread.
 */
#include "mpi_backend.h"

#include <chrono>
#include <climits>
#include <cstring>
#include <sstream>
#include <thread>

#include "half.h"

namespace raf_dist {
namespace ccl {
namespace {

// ---- 16-bit float reductions: MPI has none, so reduce pairwise in float32 ----------------
template <float (*ToF)(uint16_t), uint16_t (*FromF)(float), int kOp>
void Reduce16(void* in, void* inout, int* len, MPI_Datatype*) {
  const uint16_t* a = static_cast<const uint16_t*>(in);
  uint16_t* b = static_cast<uint16_t*>(inout);
  for (int i = 0; i < *len; ++i) {
    float x = ToF(a[i]), y = ToF(b[i]);
    float r = kOp == 0 ? x + y : (kOp == 1 ? (x > y ? x : y) : (x < y ? x : y));
    b[i] = FromF(r);
  }
}

struct Float16Ops {
  MPI_Op ops[2][3];  // [f16, bf16][sum, max, min]
  Float16Ops() {
    MPI_Op_create(&Reduce16<HalfToFloat, FloatToHalf, 0>, 1, &ops[0][0]);
    MPI_Op_create(&Reduce16<HalfToFloat, FloatToHalf, 1>, 1, &ops[0][1]);
    MPI_Op_create(&Reduce16<HalfToFloat, FloatToHalf, 2>, 1, &ops[0][2]);
    MPI_Op_create(&Reduce16<BF16ToFloat, FloatToBF16, 0>, 1, &ops[1][0]);
    MPI_Op_create(&Reduce16<BF16ToFloat, FloatToBF16, 1>, 1, &ops[1][1]);
    MPI_Op_create(&Reduce16<BF16ToFloat, FloatToBF16, 2>, 1, &ops[1][2]);
  }
};

const Float16Ops& GetFloat16Ops() {
  static Float16Ops ops;  // created on first use, after MPI_Init
  return ops;
}

MPI_Datatype ToMpiType(ElemType t) {
  switch (t) {
    case ElemType::kF16:
    case ElemType::kBF16:
      return MPI_UINT16_T;
    case ElemType::kF32:
      return MPI_FLOAT;
    case ElemType::kF64:
      return MPI_DOUBLE;
    case ElemType::kI32:
      return MPI_INT32_T;
    case ElemType::kI64:
      return MPI_INT64_T;
  }
  return MPI_BYTE;
}

MPI_Op ToMpiOp(ReduceOp op, ElemType t) {
  int which = op == ReduceOp::kMax ? 1 : (op == ReduceOp::kMin ? 2 : 0);  // avg reduces as sum
  if (t == ElemType::kF16 || t == ElemType::kBF16) {
    return GetFloat16Ops().ops[t == ElemType::kBF16 ? 1 : 0][which];
  }
  return which == 0 ? MPI_SUM : (which == 1 ? MPI_MAX : MPI_MIN);
}

/*! \brief avg = sum / N, in the buffer's own type (integers truncate, as NCCL's ncclAvg). */
void DivideInPlace(void* data, int64_t count, ElemType t, int n) {
  switch (t) {
    case ElemType::kF16: {
      auto* p = static_cast<uint16_t*>(data);
      for (int64_t i = 0; i < count; ++i) p[i] = FloatToHalf(HalfToFloat(p[i]) / n);
      break;
    }
    case ElemType::kBF16: {
      auto* p = static_cast<uint16_t*>(data);
      for (int64_t i = 0; i < count; ++i) p[i] = FloatToBF16(BF16ToFloat(p[i]) / n);
      break;
    }
    case ElemType::kF32: {
      auto* p = static_cast<float*>(data);
      for (int64_t i = 0; i < count; ++i) p[i] /= static_cast<float>(n);
      break;
    }
    case ElemType::kF64: {
      auto* p = static_cast<double*>(data);
      for (int64_t i = 0; i < count; ++i) p[i] /= n;
      break;
    }
    case ElemType::kI32: {
      auto* p = static_cast<int32_t*>(data);
      for (int64_t i = 0; i < count; ++i) p[i] /= n;
      break;
    }
    case ElemType::kI64: {
      auto* p = static_cast<int64_t*>(data);
      for (int64_t i = 0; i < count; ++i) p[i] /= n;
      break;
    }
  }
}

int ToInt(int64_t count) {
  if (count > INT_MAX) {
    TVM_FFI_THROW(ValueError) << "collective of " << count
                              << " elements exceeds MPI's int count; split the buffer";
  }
  return static_cast<int>(count);
}

void CheckMpi(int code, const char* what) {
  if (code == MPI_SUCCESS) return;
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(code, msg, &len);
  TVM_FFI_THROW(RuntimeError) << "MPI " << what << " failed: " << std::string(msg, len);
}

}  // namespace

MpiBackend::MpiBackend(MPI_Comm comm) {
  int provided = 0;
  MPI_Query_thread(&provided);
  if (provided < MPI_THREAD_MULTIPLE) {
    TVM_FFI_THROW(RuntimeError) << "MPI was initialised without MPI_THREAD_MULTIPLE (level "
                                << provided
                                << "); raf_dist runs collectives on a background thread. "
                                   "Let mpi4py initialise MPI (its default is THREAD_MULTIPLE)";
  }
  CheckMpi(MPI_Comm_dup(comm, &comm_), "Comm_dup");
  MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
  MPI_Comm_rank(comm_, &rank_);
  MPI_Comm_size(comm_, &size_);
  GetFloat16Ops();
  thread_ = std::thread([this] { Loop(); });
}

MpiBackend::~MpiBackend() { Shutdown(); }

void MpiBackend::Shutdown() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return;
    stopping_ = true;
  }
  cv_.notify_all();
  if (IsBroken()) {
    // the thread may be inside an MPI call that waits for a dead peer: joining it (or freeing
    // the communicator under it) would hang the exit. The process is ending; leave both.
    if (thread_.joinable()) thread_.detach();
    return;
  }
  if (thread_.joinable()) thread_.join();
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized && comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
}

std::shared_ptr<Work> MpiBackend::Start(CollectiveCall call) {
  auto work = std::make_shared<Work>(std::move(call));
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) {
      TVM_FFI_THROW(RuntimeError) << "collective started after raf_dist.ccl.shutdown()";
    }
    queue_.push_back(work);
  }
  cv_.notify_one();
  return work;
}

void MpiBackend::RunBlocking(CollectiveCall call) {
  // With a timeout (the default) every call goes through the communication thread and the
  // caller waits on it with the deadline (Work::Wait): a blocking MPI call waiting for a dead
  // or stuck peer cannot be interrupted, a wait can. Running the call in MPI's nonblocking
  // form on this thread instead would need every call in that form (MPI never matches a
  // nonblocking collective with a blocking one, and which path a call takes depends on
  // timing, so it differs between ranks), and MPICH's nonblocking algorithms measured up to
  // 10x slower (MPI_Ireduce_scatter_block at 1 MB, 2 ranks; docs/design-notes.md).
  if (WaitTimeoutSeconds() > 0) {
    Start(std::move(call))->Wait();
    return;
  }
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (stopping_) {
      TVM_FFI_THROW(RuntimeError) << "collective started after raf_dist.ccl.shutdown()";
    }
    if (busy_ || !queue_.empty()) {
      lock.unlock();
      Start(std::move(call))->Wait();
      return;
    }
    busy_ = true;
  }
  struct Release {
    MpiBackend* self;
    ~Release() {
      {
        std::lock_guard<std::mutex> lock(self->mu_);
        self->busy_ = false;
      }
      self->cv_.notify_all();
    }
  } release{this};
  MPI_Request request = Run(call);
  if (request != MPI_REQUEST_NULL) {
    CheckMpi(MPI_Wait(&request, MPI_STATUS_IGNORE), KindName(call.kind));
  }
}

void MpiBackend::Loop() {
  while (true) {
    std::shared_ptr<Work> work;
    {
      std::unique_lock<std::mutex> lock(mu_);
      auto ready = [this] { return stopping_ || (!queue_.empty() && !busy_); };
      if (posted_.empty()) {
        cv_.wait(lock, ready);
      } else {  // sends/recvs in flight: poll them while waiting for new work
        cv_.wait_for(lock, std::chrono::microseconds(20), ready);
      }
      if (queue_.empty() || busy_) {
        bool stopping = stopping_ && queue_.empty();
        lock.unlock();
        PollPointToPoint();
        if (stopping && posted_.empty()) return;  // stopping and drained
        continue;
      }
      work = queue_.front();
      queue_.pop_front();
      busy_ = true;
    }
    std::string error;
    MPI_Request request = MPI_REQUEST_NULL;
    try {
      request = Run(work->call());
    } catch (const std::exception& e) {
      error = e.what();
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      busy_ = false;
    }
    if (request != MPI_REQUEST_NULL) {
      posted_.emplace_back(request, std::move(work));
    } else {
      work->Finish(std::move(error));
    }
    PollPointToPoint();
  }
}

void MpiBackend::PollPointToPoint() {
  for (size_t i = 0; i < posted_.size();) {
    int done = 0;
    int code = MPI_Test(&posted_[i].first, &done, MPI_STATUS_IGNORE);
    if (!done && code == MPI_SUCCESS) {
      ++i;
      continue;
    }
    std::string error;
    if (code != MPI_SUCCESS) {
      char msg[MPI_MAX_ERROR_STRING];
      int len = 0;
      MPI_Error_string(code, msg, &len);
      error = "MPI " + std::string(KindName(posted_[i].second->call().kind)) +
              " failed: " + std::string(msg, len);
    }
    posted_[i].second->Finish(std::move(error));
    posted_.erase(posted_.begin() + static_cast<std::ptrdiff_t>(i));
  }
}

MPI_Request MpiBackend::Run(const CollectiveCall& c) {
  MPI_Datatype dtype = ToMpiType(c.elem);
  size_t esize = ElemSize(c.elem);
  switch (c.kind) {
    case CollectiveKind::kAllReduce: {
      void* recv = DataPtr(c.recv);
      const void* send = DataPtr(c.send);
      const void* src = send == recv ? MPI_IN_PLACE : send;
      CheckMpi(MPI_Allreduce(src, recv, ToInt(c.recv_count), dtype, ToMpiOp(c.op, c.elem), comm_),
               "Allreduce");
      if (c.op == ReduceOp::kAvg) DivideInPlace(recv, c.recv_count, c.elem, size_);
      break;
    }
    case CollectiveKind::kReduceScatter: {
      // one MPI reduce-scatter per full tensor, each into its place in the shard buffer
      char* recv = static_cast<char*>(DataPtr(c.recv));
      MPI_Op op = ToMpiOp(c.op, c.elem);
      ForEachShard(FullTensors(c), size_, rank_, [&](const ffi::Tensor& t, const TensorShard& s) {
        char* out = recv + s.offset * esize;
        if (s.even) {
          CheckMpi(MPI_Reduce_scatter_block(DataPtr(t), out, ToInt(s.shard), dtype, op, comm_),
                   "Reduce_scatter_block");
        } else {
          std::vector<int> counts(size_);
          for (int r = 0; r < size_; ++r) counts[r] = ToInt(ValidCount(s.numel, s.shard, r));
          CheckMpi(MPI_Reduce_scatter(DataPtr(t), out, counts.data(), dtype, op, comm_),
                   "Reduce_scatter");
          std::memset(out + s.valid * esize, 0, (s.shard - s.valid) * esize);  // the padding
        }
      });
      if (c.op == ReduceOp::kAvg) DivideInPlace(recv, c.recv_count, c.elem, size_);
      break;
    }
    case CollectiveKind::kAllGather: {
      // one MPI allgather per full tensor, straight into it, from its place in the shards
      const char* send = static_cast<const char*>(DataPtr(c.send));
      ForEachShard(FullTensors(c), size_, rank_, [&](const ffi::Tensor& t, const TensorShard& s) {
        const char* in = send + s.offset * esize;
        if (s.even) {
          CheckMpi(MPI_Allgather(in, ToInt(s.shard), dtype, DataPtr(t), ToInt(s.shard), dtype,
                                 comm_),
                   "Allgather");
        } else {
          std::vector<int> counts(size_), displs(size_);
          for (int r = 0; r < size_; ++r) {
            counts[r] = ToInt(ValidCount(s.numel, s.shard, r));
            displs[r] = ToInt(s.shard * r);
          }
          CheckMpi(MPI_Allgatherv(in, ToInt(s.valid), dtype, DataPtr(t), counts.data(),
                                  displs.data(), dtype, comm_),
                   "Allgatherv");
        }
      });
      break;
    }
    case CollectiveKind::kBroadcast: {
      void* recv = DataPtr(c.recv);
      if (rank_ == c.peer && DataPtr(c.send) != recv) {
        std::memcpy(recv, DataPtr(c.send), c.recv_count * esize);
      }
      CheckMpi(MPI_Bcast(recv, ToInt(c.recv_count), dtype, c.peer, comm_), "Bcast");
      break;
    }
    case CollectiveKind::kSend: {
      MPI_Request request;
      CheckMpi(MPI_Isend(DataPtr(c.send), ToInt(c.send_count), dtype, c.peer, 0, comm_, &request),
               "Isend");
      return request;
    }
    case CollectiveKind::kRecv: {
      MPI_Request request;
      CheckMpi(MPI_Irecv(DataPtr(c.recv), ToInt(c.recv_count), dtype, c.peer, 0, comm_, &request),
               "Irecv");
      return request;
    }
    case CollectiveKind::kBarrier:
      CheckMpi(MPI_Barrier(comm_), "Barrier");
      break;
    case CollectiveKind::kAllToAll: {
      if (c.send_splits.empty()) {
        const int block = ToInt(c.send_count / size_);
        CheckMpi(MPI_Alltoall(DataPtr(c.send), block, dtype, DataPtr(c.recv), block, dtype,
                              comm_),
                 "Alltoall");
        break;
      }
      std::vector<int> send_counts(size_), send_displs(size_), recv_counts(size_),
          recv_displs(size_);
      int64_t send_offset = 0, recv_offset = 0;
      for (int r = 0; r < size_; ++r) {
        send_counts[r] = ToInt(c.send_splits[r]);
        send_displs[r] = ToInt(send_offset);
        send_offset += c.send_splits[r];
        recv_counts[r] = ToInt(c.recv_splits[r]);
        recv_displs[r] = ToInt(recv_offset);
        recv_offset += c.recv_splits[r];
      }
      CheckMpi(MPI_Alltoallv(DataPtr(c.send), send_counts.data(), send_displs.data(), dtype,
                             DataPtr(c.recv), recv_counts.data(), recv_displs.data(), dtype,
                             comm_),
               "Alltoallv");
      break;
    }
    default:
      TVM_FFI_THROW(InternalError) << "unknown collective kind";
  }
  return MPI_REQUEST_NULL;
}

}  // namespace ccl
}  // namespace raf_dist
