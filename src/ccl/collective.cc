/*!
 * \file collective.cc
 * \brief Names, dtype mapping and the Work handle shared by all backends.
 */
#include <atomic>
#include "collective.h"

#include <array>
#include <chrono>
#include <cstdlib>
#include <mutex>
#include <sstream>

namespace raf_dist {
namespace ccl {

const char* KindName(CollectiveKind kind) {
  switch (kind) {
    case CollectiveKind::kAllReduce:
      return "allreduce";
    case CollectiveKind::kReduceScatter:
      return "reduce_scatter";
    case CollectiveKind::kAllGather:
      return "allgather";
    case CollectiveKind::kBroadcast:
      return "broadcast";
    case CollectiveKind::kSend:
      return "send";
    case CollectiveKind::kRecv:
      return "recv";
    case CollectiveKind::kBarrier:
      return "barrier";
    case CollectiveKind::kAllToAll:
      return "alltoall";
    default:
      return "unknown";
  }
}

ReduceOp ParseReduceOp(const std::string& name) {
  if (name == "sum") return ReduceOp::kSum;
  if (name == "avg" || name == "mean") return ReduceOp::kAvg;
  if (name == "max") return ReduceOp::kMax;
  if (name == "min") return ReduceOp::kMin;
  TVM_FFI_THROW(ValueError) << "unknown reduce op '" << name
                            << "'; expected one of 'sum', 'avg', 'max', 'min'";
  return ReduceOp::kSum;
}

const char* ReduceOpName(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return "sum";
    case ReduceOp::kAvg:
      return "avg";
    case ReduceOp::kMax:
      return "max";
    case ReduceOp::kMin:
      return "min";
  }
  return "unknown";
}

ElemType ToElemType(DLDataType dtype, const char* what) {
  if (dtype.lanes == 1) {
    if (dtype.code == kDLFloat && dtype.bits == 16) return ElemType::kF16;
    if (dtype.code == kDLBfloat && dtype.bits == 16) return ElemType::kBF16;
    if (dtype.code == kDLFloat && dtype.bits == 32) return ElemType::kF32;
    if (dtype.code == kDLFloat && dtype.bits == 64) return ElemType::kF64;
    if (dtype.code == kDLInt && dtype.bits == 32) return ElemType::kI32;
    if (dtype.code == kDLInt && dtype.bits == 64) return ElemType::kI64;
  }
  TVM_FFI_THROW(TypeError) << what << " has dtype " << ffi::DLDataTypeToString(dtype)
                           << ", which collectives do not support; use one of float16, "
                              "bfloat16, float32, float64, int32, int64";
  return ElemType::kF32;
}

const char* ElemTypeName(ElemType t) {
  static const char* names[] = {"float16", "bfloat16", "float32", "float64", "int32", "int64"};
  return names[static_cast<int>(t)];
}

size_t ElemSize(ElemType t) {
  static const size_t sizes[] = {2, 2, 4, 8, 4, 8};
  return sizes[static_cast<int>(t)];
}

int64_t ContiguousNumel(const ffi::Tensor& t, const char* what) {
  if (!t.IsContiguous()) {
    TVM_FFI_THROW(ValueError) << what
                              << " is not contiguous; collectives need a contiguous buffer "
                                 "(copy it first, e.g. numpy.ascontiguousarray)";
  }
  return t.numel();
}

void Work::Finish(std::string error) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    done_ = true;
    error_ = std::move(error);
  }
  cv_.notify_all();
}

namespace {
struct Flight {
  int64_t group = -1;
  int group_size = 0;
  int64_t sequence = 0;
  CollectiveKind kind = CollectiveKind::kBarrier;
  ElemType elem = ElemType::kF32;
  int64_t send_count = 0;
  int64_t recv_count = 0;
  std::chrono::steady_clock::time_point start;
};
struct FlightRing {
  std::mutex mu;
  std::array<Flight, kFlightRecords> ring;
  int64_t count = 0;
};
FlightRing& Flights() {
  static FlightRing* ring = new FlightRing();  // never destroyed: used until exit
  return *ring;
}
}  // namespace

void RecordFlight(int64_t group, int group_size, int64_t sequence, const CollectiveCall& call) {
  FlightRing& f = Flights();
  std::lock_guard<std::mutex> lock(f.mu);
  f.ring[f.count % kFlightRecords] = Flight{group, group_size, sequence, call.kind, call.elem,
                                            call.send_count, call.recv_count,
                                            std::chrono::steady_clock::now()};
  ++f.count;
}

std::string RecentFlights() {
  FlightRing& f = Flights();
  std::lock_guard<std::mutex> lock(f.mu);
  std::ostringstream out;
  auto now = std::chrono::steady_clock::now();
  int64_t first = std::max<int64_t>(0, f.count - kFlightRecords);
  for (int64_t i = first; i < f.count; ++i) {
    const Flight& x = f.ring[i % kFlightRecords];
    double age = std::chrono::duration<double>(now - x.start).count();
    out << "\n  #" << i << " group " << x.group << " (" << x.group_size << " ranks) seq "
        << x.sequence << ": " << KindName(x.kind) << " of " << x.send_count << "/"
        << x.recv_count << " " << ElemTypeName(x.elem) << ", started " << age << " s ago";
  }
  return out.str();
}

namespace {
struct BrokenState {
  std::mutex mu;
  bool broken = false;
  std::string reason;
};
BrokenState& Broken() {
  static BrokenState* state = new BrokenState();  // never destroyed: read until exit
  return *state;
}
}  // namespace

void MarkBroken(const std::string& reason) {
  BrokenState& b = Broken();
  std::lock_guard<std::mutex> lock(b.mu);
  if (!b.broken) {
    b.broken = true;
    b.reason = reason;
  }
}

bool IsBroken(std::string* reason) {
  BrokenState& b = Broken();
  std::lock_guard<std::mutex> lock(b.mu);
  if (b.broken && reason) *reason = b.reason;
  return b.broken;
}

std::string TimeoutMessage(const CollectiveCall& call, double timeout) {
  std::ostringstream out;
  out << KindName(call.kind) << " of " << call.send_count << "/" << call.recv_count << " "
      << ElemTypeName(call.elem) << " elements did not complete within " << timeout
      << " s (RAF_DIST_COLLECTIVE_TIMEOUT_S); a peer rank has probably died or is running a "
         "different program. This rank's last collectives (flight recorder):"
      << RecentFlights();
  return out.str();
}

namespace {
// Set by Python (raf_dist.env reads RAF_DIST_COLLECTIVE_TIMEOUT_S / the config, validated)
// before the first group is made; 0: wait forever.
std::atomic<double> wait_timeout_s{0.0};
}  // namespace

void SetWaitTimeoutSeconds(double seconds) { wait_timeout_s.store(seconds > 0 ? seconds : 0.0); }

double WaitTimeoutSeconds() { return wait_timeout_s.load(); }

void Work::Wait() {
  std::unique_lock<std::mutex> lock(mu_);
  double timeout = WaitTimeoutSeconds();
  if (timeout > 0) {
    auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout);
    if (!cv_.wait_until(lock, deadline, [this] { return done_; })) {
      std::string message = TimeoutMessage(call_, timeout);
      MarkBroken(message);
      TVM_FFI_THROW(TimeoutError) << message;
    }
  } else {
    cv_.wait(lock, [this] { return done_; });
  }
  if (!error_.empty()) {
    TVM_FFI_THROW(RuntimeError) << error_;
  }
}

}  // namespace ccl
}  // namespace raf_dist
