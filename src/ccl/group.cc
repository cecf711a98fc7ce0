/*!
 * \file group.cc
 * \brief Process group: validation, accounting, signature check, backend dispatch.
 */
#include "group.h"

#include <sstream>

namespace raf_dist {
namespace ccl {

void Counters::Add(CollectiveKind kind, double bytes) {
  int k = static_cast<int>(kind);
  calls[k].fetch_add(1);
  double old = bus_bytes[k].load();
  while (!bus_bytes[k].compare_exchange_weak(old, old + bytes)) {
  }
}

void Counters::Reset() {
  for (auto& c : calls) c.store(0);
  for (auto& b : bus_bytes) b.store(0.0);
}

Counters& GlobalCounters() {
  static Counters counters;
  return counters;
}

namespace {

/*! \brief Bus bytes as nccl-tests defines them, so numbers compare with DESIGN.md section 3;
 *         an uneven alltoall counts the bytes this rank sends to the others. */
double BusBytes(const CollectiveCall& c, int n, int rank) {
  double esize = static_cast<double>(ElemSize(c.elem));
  double ratio = static_cast<double>(n - 1) / n;
  switch (c.kind) {
    case CollectiveKind::kAllReduce:
      return 2.0 * ratio * c.recv_count * esize;
    case CollectiveKind::kReduceScatter:
      return ratio * c.send_count * esize;
    case CollectiveKind::kAllGather:
      return ratio * c.recv_count * esize;
    case CollectiveKind::kBroadcast:
    case CollectiveKind::kRecv:
      return c.recv_count * esize;
    case CollectiveKind::kSend:
      return c.send_count * esize;
    case CollectiveKind::kAllToAll: {
      if (c.send_splits.empty()) return ratio * c.send_count * esize;
      int64_t out = 0;
      for (int j = 0; j < n; ++j) out += j == rank ? 0 : c.send_splits[j];
      return out * esize;
    }
    default:
      return 0.0;
  }
}

std::string Describe(const int64_t* sig) {
  std::ostringstream os;
  auto kind = static_cast<CollectiveKind>(sig[0]);
  os << KindName(kind) << "(";
  if (kind == CollectiveKind::kAllReduce || kind == CollectiveKind::kReduceScatter) {
    os << ReduceOpName(static_cast<ReduceOp>(sig[1])) << ", ";
  }
  if (kind != CollectiveKind::kBarrier && sig[3] < 0) {  // an uneven alltoall's counts differ
    os << ElemTypeName(static_cast<ElemType>(sig[2])) << ", uneven splits, ";
  } else if (kind != CollectiveKind::kBarrier) {
    os << ElemTypeName(static_cast<ElemType>(sig[2])) << ", send " << sig[3] << ", recv "
       << sig[4] << ", ";
  }
  os << "call #" << sig[5] << ")";
  return os.str();
}

}  // namespace

Group::Group(MPI_Comm comm, bool check_signatures) : check_signatures_(check_signatures) {
  mpi_ = std::make_unique<MpiBackend>(comm);
  rank_ = mpi_->rank();
  size_ = mpi_->size();
  MPI_Comm_dup(comm, &check_comm_);
  MPI_Comm_dup(comm, &nccl_bootstrap_comm_);
}

Group::~Group() { Shutdown(); }

void Group::Shutdown() {
  std::lock_guard<std::mutex> lock(mu_);
  nccl_.reset();  // after a failure the NCCL backend aborts its communicator (nccl_backend.cc)
  if (mpi_) mpi_->Shutdown();
  if (IsBroken()) return;  // another thread may still be inside MPI on these communicators
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) {
    if (check_comm_ != MPI_COMM_NULL) MPI_Comm_free(&check_comm_);
    if (nccl_bootstrap_comm_ != MPI_COMM_NULL) MPI_Comm_free(&nccl_bootstrap_comm_);
  }
}

void Group::Validate(CollectiveCall* c) const {
  const char* name = KindName(c->kind);
  std::string send_what = std::string(name) + " input";
  std::string recv_what = std::string(name) + " output";
  if (c->send.defined()) {
    c->send_count = ContiguousNumel(c->send, send_what.c_str());
    c->elem = ToElemType(c->send.dtype(), send_what.c_str());
  }
  if (c->recv.defined()) {
    c->recv_count = ContiguousNumel(c->recv, recv_what.c_str());
    ElemType recv_elem = ToElemType(c->recv.dtype(), recv_what.c_str());
    if (c->send.defined() && recv_elem != c->elem) {
      TVM_FFI_THROW(TypeError) << name << ": input is " << ElemTypeName(c->elem)
                               << " but output is " << ElemTypeName(recv_elem)
                               << "; both buffers must have the same dtype";
    }
    c->elem = recv_elem;
  }
  if (c->send.defined() && c->recv.defined() &&
      c->send.device().device_type != c->recv.device().device_type) {
    TVM_FFI_THROW(ValueError) << name
                              << ": input and output live on different devices; move both to "
                                 "the host or both to the same GPU";
  }
  if (!c->parts.empty()) {
    ValidateParts(c);
    return;
  }
  switch (c->kind) {
    case CollectiveKind::kAllReduce:
    case CollectiveKind::kBroadcast:
      if (c->send_count != c->recv_count) {
        TVM_FFI_THROW(ValueError) << name << ": input has " << c->send_count
                                  << " elements but output has " << c->recv_count
                                  << "; they must match";
      }
      break;
    case CollectiveKind::kReduceScatter:
      if (c->recv_count != ShardCount(c->send_count, size_)) {
        TVM_FFI_THROW(ValueError)
            << "reduce_scatter: output has " << c->recv_count << " elements, expected ceil("
            << c->send_count << " / " << size_ << ") = " << ShardCount(c->send_count, size_)
            << " (one padded shard of the input per rank)";
      }
      break;
    case CollectiveKind::kAllGather:
      if (c->send_count != ShardCount(c->recv_count, size_)) {
        TVM_FFI_THROW(ValueError)
            << "allgather: input has " << c->send_count << " elements, expected ceil("
            << c->recv_count << " / " << size_ << ") = " << ShardCount(c->recv_count, size_)
            << " (one padded shard of the output per rank)";
      }
      break;
    case CollectiveKind::kAllToAll:
      ValidateAllToAll(*c);
      break;
    default:
      break;
  }
  bool rooted = c->kind == CollectiveKind::kBroadcast || c->kind == CollectiveKind::kSend ||
                c->kind == CollectiveKind::kRecv;
  if (rooted && (c->peer < 0 || c->peer >= size_)) {
    TVM_FFI_THROW(ValueError) << name << ": rank " << c->peer << " is outside the group of "
                              << size_ << " ranks (valid: 0.." << size_ - 1 << ")";
  }
  if ((c->kind == CollectiveKind::kSend || c->kind == CollectiveKind::kRecv) &&
      c->peer == rank_) {
    TVM_FFI_THROW(ValueError) << name << ": rank " << rank_
                              << " cannot exchange a message with itself";
  }
}

void Group::ValidateAllToAll(const CollectiveCall& c) const {
  // overlapping buffers (an empty one has no extent: a zero-size GPU array's pointer is null)
  const char* send = static_cast<const char*>(DataPtr(c.send));
  const char* recv = static_cast<const char*>(DataPtr(c.recv));
  const int64_t esize = static_cast<int64_t>(ElemSize(c.elem));
  if (c.send_count > 0 && c.recv_count > 0 && send < recv + c.recv_count * esize &&
      recv < send + c.send_count * esize) {
    TVM_FFI_THROW(ValueError) << "alltoall cannot run in place: give it an output buffer of "
                                 "its own";
  }
  if (c.send_count > INT32_MAX || c.recv_count > INT32_MAX) {  // MPI's int counts and offsets
    TVM_FFI_THROW(ValueError) << "alltoall of " << std::max(c.send_count, c.recv_count)
                              << " elements exceeds MPI's int counts and offsets; split the "
                                 "exchange";
  }
  if (c.send_splits.empty() != c.recv_splits.empty()) {
    TVM_FFI_THROW(ValueError) << "alltoall: give both send and receive splits, or neither";
  }
  if (c.send_splits.empty()) {
    if (c.send_count != c.recv_count || c.send_count % size_ != 0) {
      TVM_FFI_THROW(ValueError)
          << "alltoall: input has " << c.send_count << " elements and output "
          << c.recv_count << "; both must hold the same count, a multiple of the " << size_
          << " ranks (one equal block per rank), or pass splits (alltoallv)";
    }
    return;
  }
  const std::vector<int64_t>* splits[2] = {&c.send_splits, &c.recv_splits};
  const int64_t counts[2] = {c.send_count, c.recv_count};
  const char* names[2] = {"send", "receive"};
  for (int side = 0; side < 2; ++side) {
    const std::vector<int64_t>& s = *splits[side];
    if (static_cast<int>(s.size()) != size_) {
      TVM_FFI_THROW(ValueError) << "alltoallv: " << s.size() << " " << names[side]
                                << " splits for a group of " << size_
                                << " ranks; give one count per rank";
    }
    int64_t total = 0;
    for (int j = 0; j < size_; ++j) {
      if (s[j] < 0 || s[j] > counts[side]) {  // (bounded, so the sum cannot overflow)
        TVM_FFI_THROW(ValueError) << "alltoallv: " << names[side] << " split " << j << " is "
                                  << s[j] << "; each count must be between 0 and the "
                                  << counts[side] << " elements of the buffer";
      }
      total += s[j];
    }
    if (total != counts[side]) {
      TVM_FFI_THROW(ValueError) << "alltoallv: the " << names[side] << " splits sum to " << total
                                << " elements but the " << (side ? "output" : "input")
                                << " holds " << counts[side] << "; they must match";
    }
  }
}

void Group::CheckSplits(const CollectiveCall& c) {
  // what every rank sends me must be what I expect from it: one alltoall of the splits, then
  // every rank learns whether any rank saw a difference (so all raise, none hangs)
  std::vector<int64_t> incoming(size_);
  MPI_Alltoall(c.send_splits.data(), 1, MPI_INT64_T, incoming.data(), 1, MPI_INT64_T,
               check_comm_);
  std::ostringstream mine;
  for (int j = 0; j < size_; ++j) {
    if (incoming[j] != c.recv_splits[j]) {
      mine << "\n  rank " << j << " sends " << incoming[j] << " elements to rank " << rank_
           << ", which expects " << c.recv_splits[j];
    }
  }
  int ok = mine.str().empty() ? 1 : 0, all_ok = 0;
  MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, check_comm_);
  if (!all_ok) {
    TVM_FFI_THROW(RuntimeError)
        << "collective mismatch detected by RAF_DIST_CHECK_COLLECTIVES (seen on rank " << rank_
        << "): the alltoallv splits disagree"
        << (ok ? std::string(" on another rank") : mine.str())
        << "\nRank i's send split j must equal rank j's receive split i.";
  }
}

void Group::ValidateParts(CollectiveCall* c) const {
  const char* name = KindName(c->kind);
  const bool scatter = c->kind == CollectiveKind::kReduceScatter;
  if (!scatter && c->kind != CollectiveKind::kAllGather) {
    TVM_FFI_THROW(InternalError) << name << " takes one tensor each way, not several";
  }
  const ffi::Tensor& shard = ShardTensor(*c);
  if (!shard.defined() || (scatter ? c->send.defined() : c->recv.defined())) {
    TVM_FFI_THROW(InternalError) << name << " of several tensors needs the shard buffer only";
  }
  int64_t total = 0;
  for (size_t i = 0; i < c->parts.size(); ++i) {
    const ffi::Tensor& t = c->parts[i];
    std::string what =
        std::string(name) + (scatter ? " input " : " output ") + std::to_string(i);
    const int64_t numel = ContiguousNumel(t, what.c_str());
    if (ToElemType(t.dtype(), what.c_str()) != c->elem) {
      TVM_FFI_THROW(TypeError) << what << " is " << ffi::DLDataTypeToString(t.dtype())
                               << " but the shard buffer is " << ElemTypeName(c->elem)
                               << "; every tensor of the call must have the shard's dtype";
    }
    if (t.device().device_type != shard.device().device_type ||
        t.device().device_id != shard.device().device_id) {
      TVM_FFI_THROW(ValueError) << what << " lives on another device than the shard buffer; "
                                   "keep every tensor of the call on one device";
    }
    total += numel;
  }
  const int64_t shards = ShardBufferCount(c->parts, size_);
  const int64_t have = scatter ? c->recv_count : c->send_count;
  if (have != shards) {
    TVM_FFI_THROW(ValueError) << name << ": the shard buffer has " << have
                              << " elements, expected " << shards << " (the sum of ceil(n_i / "
                              << size_ << ") over the " << c->parts.size()
                              << " full tensors: this rank's shard of each, back to back)";
  }
  (scatter ? c->send_count : c->recv_count) = total;
}

void Group::CheckSignature(const CollectiveCall& c) {
  constexpr int kFields = 6;
  int64_t mine[kFields] = {static_cast<int64_t>(c.kind), static_cast<int64_t>(c.op),
                           static_cast<int64_t>(c.elem), c.send_count,
                           c.recv_count, sequence_};
  if (c.kind == CollectiveKind::kBarrier) mine[1] = mine[2] = mine[3] = mine[4] = 0;
  const bool uneven = c.kind == CollectiveKind::kAllToAll && !c.send_splits.empty();
  if (uneven) mine[3] = mine[4] = -1;  // counts differ by rank: CheckSplits pairs them
  std::vector<int64_t> all(static_cast<size_t>(kFields) * size_);
  MPI_Allgather(mine, kFields, MPI_INT64_T, all.data(), kFields, MPI_INT64_T, check_comm_);
  std::ostringstream mismatches;
  bool mismatch = false;
  for (int r = 1; r < size_; ++r) {
    const int64_t* other = &all[static_cast<size_t>(r) * kFields];
    if (!std::equal(other, other + kFields, all.data())) {
      mismatch = true;
      mismatches << "\n  rank 0: " << Describe(all.data()) << "\n  rank " << r << ": "
                 << Describe(other);
    }
  }
  if (mismatch) {
    TVM_FFI_THROW(RuntimeError)
        << "collective mismatch detected by RAF_DIST_CHECK_COLLECTIVES (seen on rank " << rank_
        << "): ranks called different collectives at the same point" << mismatches.str()
        << "\nEvery rank must issue the same collectives, with the same dtypes and sizes, in "
           "the same order.";
  }
  if (uneven) CheckSplits(c);
}

Backend* Group::BackendFor(const CollectiveCall& c) {
  const ffi::Tensor& t = c.send.defined() ? c.send : c.recv;
  if (!t.defined() || t.device().device_type == kDLCPU ||
      t.device().device_type == kDLCUDAHost) {
    return mpi_.get();
  }
  if (t.device().device_type != kDLCUDA) {
    TVM_FFI_THROW(ValueError) << KindName(c.kind) << ": tensors on device type "
                              << static_cast<int>(t.device().device_type)
                              << " are not supported; use host (MPI) or CUDA (NCCL) memory";
  }
  if (!nccl_) {
    // Every rank reaches its first CUDA collective at the same point (SPMD), so the NCCL
    // communicator is created collectively here.
    nccl_ = CreateNcclBackend(nccl_bootstrap_comm_, t.device().device_id);
    nccl_device_ = t.device().device_id;
  } else if (t.device().device_id != nccl_device_) {
    TVM_FFI_THROW(ValueError) << KindName(c.kind) << ": tensor on cuda:" << t.device().device_id
                              << " but this rank's NCCL communicator is on cuda:"
                              << nccl_device_ << "; keep one GPU per rank";
  }
  return nccl_.get();
}

Backend* Group::Prepare(CollectiveCall* call) {
  Validate(call);
  if (!mpi_) TVM_FFI_THROW(RuntimeError) << "collective on a group that was shut down";
  std::string broken;
  if (IsBroken(&broken)) {
    TVM_FFI_THROW(RuntimeError)
        << KindName(call->kind) << " refused: this rank's collectives were shut off after an "
        << "earlier failure, and the other ranks are being ended. Restart the job (from the "
           "last checkpoint). The failure: "
        << broken;
  }
  Backend* backend = BackendFor(*call);
  bool point_to_point = call->kind == CollectiveKind::kSend || call->kind == CollectiveKind::kRecv;
  if (check_signatures_ && !point_to_point) CheckSignature(*call);
  if (!point_to_point) ++sequence_;
  RecordFlight(id_, size_, sequence_, *call);
  double bytes = BusBytes(*call, size_, rank_);
  GlobalCounters().Add(call->kind, bytes);
  counters_.Add(call->kind, bytes);
  return backend;
}

std::shared_ptr<Work> Group::Start(CollectiveCall call) {
  std::lock_guard<std::mutex> lock(mu_);
  return Prepare(&call)->Start(std::move(call));
}

void Group::Run(CollectiveCall call) {
  // The group lock orders submissions; it is released before a blocking run so that other
  // threads can still submit (they queue behind it in the backend).
  Backend* backend;
  {
    std::lock_guard<std::mutex> lock(mu_);
    backend = Prepare(&call);
  }
  backend->RunBlocking(std::move(call));
}

}  // namespace ccl
}  // namespace raf_dist
