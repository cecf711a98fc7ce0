/*!
 * \file registry.cc
 * \brief The `raf_dist.ccl.*` global functions, callable from compiled Relax code and from
 *        Python on any DLPack tensor (numpy arrays through tvm_ffi.from_dlpack).
 *
 * Outputs come last, so each collective serves both Relax forms:
 *  - destination passing: R.call_dps_packed("raf_dist.ccl.allreduce", (x, "sum", 0), out_sinfo)
 *  - in place: R.call_packed("raf_dist.ccl.allreduce", g, "sum", 0, g) (input aliases output)
 * reduce_scatter takes several inputs and allgather several outputs (a ZeRO bucket's tensors,
 * exchanged where they live; collective.h): reduce_scatter(t_1, ..., t_k, op, group, shards),
 * allgather(shards, group, t_1, ..., t_k); alltoall(send, group, recv) in equal blocks, or
 * alltoall(send, send_splits, recv_splits, group, recv) with int64 host tensors of counts.
 * `<name>_start` takes the same arguments and returns an int64 handle; `raf_dist.ccl.wait`
 * completes it. Extra arguments to wait are ignored: passing the in-flight buffers there keeps
 * them named until the wait, so a memory planner cannot reuse their storage (DESIGN.md s.5).
 */
#include <tvm/ffi/container/map.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/reflection/registry.h>

#include <unordered_map>
#include <utility>

#include "group.h"

namespace raf_dist {
namespace ccl {
namespace {

struct State {
  std::mutex mu;
  std::vector<std::unique_ptr<Group>> groups;
  std::unordered_map<int64_t, std::shared_ptr<Work>> pending;
  int64_t next_handle = 1;
};

State& GetState() {
  static State* state = new State();  // never destroyed: outlives static destructors at exit
  return *state;
}

Group* GetGroup(int64_t id) {
  State& s = GetState();
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.groups.empty()) {
    TVM_FFI_THROW(RuntimeError) << "raf_dist collectives are not initialised; call "
                                   "raf_dist.distributed.get_communicator() first";
  }
  if (id < 0 || id >= static_cast<int64_t>(s.groups.size()) || !s.groups[id]) {
    TVM_FFI_THROW(ValueError) << "unknown process group " << id << " (" << s.groups.size()
                              << " created)";
  }
  return s.groups[id].get();
}

void RunCall(int64_t group, CollectiveCall call) { GetGroup(group)->Run(std::move(call)); }

int64_t StartCall(int64_t group, CollectiveCall call) {
  std::shared_ptr<Work> work = GetGroup(group)->Start(std::move(call));
  State& s = GetState();
  std::lock_guard<std::mutex> lock(s.mu);
  int64_t handle = s.next_handle++;
  s.pending.emplace(handle, std::move(work));
  return handle;
}

void WaitHandle(int64_t handle) {
  std::shared_ptr<Work> work;
  {
    State& s = GetState();
    std::lock_guard<std::mutex> lock(s.mu);
    auto it = s.pending.find(handle);
    if (it == s.pending.end()) {
      TVM_FFI_THROW(ValueError) << "collective handle " << handle
                                << " is unknown or was already waited on";
    }
    work = it->second;
    s.pending.erase(it);
  }
  work->Wait();
}

CollectiveCall MakeCall(CollectiveKind kind, ffi::Optional<ffi::Tensor> send,
                        ffi::Optional<ffi::Tensor> recv, ReduceOp op = ReduceOp::kSum,
                        int peer = 0) {
  CollectiveCall call;
  call.kind = kind;
  call.op = op;
  if (send.has_value()) call.send = send.value();
  if (recv.has_value()) call.recv = recv.value();
  call.peer = peer;
  return call;
}

/*! \brief The values of a host int64 tensor (alltoall's splits). */
std::vector<int64_t> HostInt64s(const ffi::Tensor& t, const char* what) {
  if (t.device().device_type != kDLCPU || t.dtype().code != kDLInt || t.dtype().bits != 64) {
    TVM_FFI_THROW(TypeError) << what << " must be an int64 tensor in host memory";
  }
  const int64_t n = ContiguousNumel(t, what);
  const int64_t* data = static_cast<const int64_t*>(DataPtr(t));
  return std::vector<int64_t>(data, data + n);
}

// One builder per collective; each is registered in a blocking and a _start form.
CollectiveCall AllReduceCall(ffi::Tensor send, ffi::String op, ffi::Tensor recv) {
  return MakeCall(CollectiveKind::kAllReduce, send, recv, ParseReduceOp(op));
}
/*! \brief reduce_scatter(t_1, ..., t_k, op, group, out): the group and the call. One tensor
 *         is the plain form; several are a bucket reduced where its tensors live
 *         (collective.h). */
std::pair<int64_t, CollectiveCall> ReduceScatterCall(ffi::PackedArgs args) {
  const int k = args.size() - 3;
  if (k < 1) {
    TVM_FFI_THROW(TypeError) << "raf_dist.ccl.reduce_scatter(t_1, ..., t_k, op, group, out)";
  }
  CollectiveCall call = MakeCall(CollectiveKind::kReduceScatter, std::nullopt,
                                 args[k + 2].cast<ffi::Tensor>(),
                                 ParseReduceOp(args[k].cast<ffi::String>()));
  for (int i = 0; i < k; ++i) call.parts.push_back(args[i].cast<ffi::Tensor>());
  if (k == 1) {  // the plain form
    call.send = std::move(call.parts[0]);
    call.parts.clear();
  }
  return {args[k + 1].cast<int64_t>(), std::move(call)};
}
/*! \brief allgather(shards, group, t_1, ..., t_k): every full tensor written in place from
 *         every rank's shards (collective.h). */
std::pair<int64_t, CollectiveCall> AllGatherCall(ffi::PackedArgs args) {
  const int k = args.size() - 2;
  if (k < 1) TVM_FFI_THROW(TypeError) << "raf_dist.ccl.allgather(shards, group, t_1, ..., t_k)";
  CollectiveCall call =
      MakeCall(CollectiveKind::kAllGather, args[0].cast<ffi::Tensor>(), std::nullopt);
  for (int i = 0; i < k; ++i) call.parts.push_back(args[i + 2].cast<ffi::Tensor>());
  if (k == 1) {  // the plain form
    call.recv = std::move(call.parts[0]);
    call.parts.clear();
  }
  return {args[1].cast<int64_t>(), std::move(call)};
}
/*! \brief alltoall(send, group, recv) or alltoall(send, send_splits, recv_splits, group,
 *         recv): the splits are int64 tensors on the host, one count per rank (collective.h). */
std::pair<int64_t, CollectiveCall> AllToAllCall(ffi::PackedArgs args) {
  if (args.size() != 3 && args.size() != 5) {
    TVM_FFI_THROW(TypeError) << "raf_dist.ccl.alltoall(send, group, recv) or "
                                "raf_dist.ccl.alltoall(send, send_splits, recv_splits, group, recv)";
  }
  const int n = args.size();
  CollectiveCall call = MakeCall(CollectiveKind::kAllToAll, args[0].cast<ffi::Tensor>(),
                                 args[n - 1].cast<ffi::Tensor>());
  if (n == 5) {
    call.send_splits = HostInt64s(args[1].cast<ffi::Tensor>(), "alltoall send splits");
    call.recv_splits = HostInt64s(args[2].cast<ffi::Tensor>(), "alltoall receive splits");
  }
  return {args[n - 2].cast<int64_t>(), std::move(call)};
}
CollectiveCall BroadcastCall(ffi::Tensor send, int64_t root, ffi::Tensor recv) {
  return MakeCall(CollectiveKind::kBroadcast, send, recv, ReduceOp::kSum, static_cast<int>(root));
}

ffi::Tensor Reinterpret(ffi::Tensor tensor, ffi::String dtype) {
  DLDataType target = ffi::StringToDLDataType(std::string(dtype));
  if (target.bits * target.lanes != tensor.dtype().bits * tensor.dtype().lanes) {
    TVM_FFI_THROW(ValueError) << "cannot view " << ffi::DLDataTypeToString(tensor.dtype())
                              << " as " << dtype << ": element sizes differ";
  }
  DLTensor prototype = *tensor.GetDLTensorPtr();
  prototype.dtype = target;
  TVMFFIObjectHandle out;
  TVM_FFI_CHECK_SAFE_CALL(TVMFFITensorCreateUnsafeView(
      ffi::details::ObjectUnsafe::TVMFFIObjectPtrFromObjectRef(tensor), &prototype, &out));
  return ffi::Tensor(ffi::details::ObjectUnsafe::ObjectPtrFromOwned<ffi::TensorObj>(
      static_cast<TVMFFIObject*>(out)));
}

/*! \brief {kind: [calls, bus bytes]}, the shape of `raf_dist.ccl.counters`. */
ffi::Map<ffi::String, ffi::Array<double>> CountersToMap(const Counters& c) {
  ffi::Map<ffi::String, ffi::Array<double>> out;
  for (int k = 0; k < static_cast<int>(CollectiveKind::kNumKinds); ++k) {
    out.Set(KindName(static_cast<CollectiveKind>(k)),
            ffi::Array<double>{static_cast<double>(c.calls[k].load()), c.bus_bytes[k].load()});
  }
  return out;
}

}  // namespace

int64_t GroupRank(int64_t group) { return GetGroup(group)->rank(); }
int64_t GroupSize(int64_t group) { return GetGroup(group)->size(); }

TVM_FFI_STATIC_INIT_BLOCK() {
  namespace refl = tvm::ffi::reflection;
  refl::GlobalDef()
      .def("raf_dist.ccl.init_group",
           [](int64_t comm_address, bool check_signatures) -> int64_t {
             MPI_Comm comm = *reinterpret_cast<MPI_Comm*>(comm_address);
             auto group = std::make_unique<Group>(comm, check_signatures);
             State& s = GetState();
             std::lock_guard<std::mutex> lock(s.mu);
             s.groups.push_back(std::move(group));
             int64_t id = static_cast<int64_t>(s.groups.size()) - 1;
             s.groups.back()->set_id(id);
             return id;
           })
      .def("raf_dist.ccl.group_rank", GroupRank)
      .def("raf_dist.ccl.group_size", GroupSize)
      .def("raf_dist.ccl.set_timeout", [](double seconds) { SetWaitTimeoutSeconds(seconds); })
      // the sharding rule the collectives use, for raf_dist.layout's test that pins the two
      .def("raf_dist.ccl.shard_count",
           [](int64_t total, int world) { return ShardCount(total, world); })
      .def("raf_dist.ccl.valid_count",
           [](int64_t total, int world, int rank) {
             return ValidCount(total, ShardCount(total, world), rank);
           })
      .def("raf_dist.ccl.shutdown",
           []() {
             State& s = GetState();
             std::unordered_map<int64_t, std::shared_ptr<Work>> pending;
             std::vector<std::unique_ptr<Group>> groups;
             {
               std::lock_guard<std::mutex> lock(s.mu);
               pending.swap(s.pending);
               groups.swap(s.groups);
             }
             // each wait is bounded by the collective timeout; one that times out marks the
             // process broken and the rest are not waited for (a peer is gone)
             for (auto& kv : pending) {
               if (IsBroken()) break;
               try {
                 kv.second->Wait();
               } catch (const std::exception&) {
                 // already reported where it was started, or the timeout marked us broken
               }
             }
             for (auto& g : groups) g->Shutdown();
             if (IsBroken()) {
               // a communication thread may be stuck in MPI holding a group: never destroy
               // them (their destructors would join it); the process is about to end
               for (auto& g : groups) g.release();
             }
           })
      // a failure this rank reported (an exception escaped a step): every later collective
      // raises, and shutdown does not wait for peers that are being ended
      .def("raf_dist.ccl.abort", [](ffi::String reason) { MarkBroken(std::string(reason)); })
      .def("raf_dist.ccl.broken",
           []() -> ffi::String {
             std::string reason;
             return IsBroken(&reason) ? ffi::String(reason) : ffi::String("");
           })
      // a handle dropped without a wait: forget it, so its buffers are freed as soon as the
      // collective completes instead of at exit
      .def("raf_dist.ccl.release",
           [](int64_t handle) -> bool {
             State& s = GetState();
             std::lock_guard<std::mutex> lock(s.mu);
             return s.pending.erase(handle) > 0;
           })
      // ---- collectives: blocking form, then the asynchronous start form ----
      .def("raf_dist.ccl.allreduce",
           [](ffi::Tensor send, ffi::String op, int64_t g, ffi::Tensor recv) {
             RunCall(g, AllReduceCall(send, op, recv));
           })
      .def("raf_dist.ccl.allreduce_start",
           [](ffi::Tensor send, ffi::String op, int64_t g, ffi::Tensor recv) {
             return StartCall(g, AllReduceCall(send, op, recv));
           })
      .def_packed("raf_dist.ccl.reduce_scatter",
                  [](ffi::PackedArgs args, ffi::Any*) {
                    auto [g, call] = ReduceScatterCall(args);
                    RunCall(g, std::move(call));
                  })
      .def_packed("raf_dist.ccl.reduce_scatter_start",
                  [](ffi::PackedArgs args, ffi::Any* rv) {
                    auto [g, call] = ReduceScatterCall(args);
                    *rv = StartCall(g, std::move(call));
                  })
      .def_packed("raf_dist.ccl.allgather",
                  [](ffi::PackedArgs args, ffi::Any*) {
                    auto [g, call] = AllGatherCall(args);
                    RunCall(g, std::move(call));
                  })
      .def_packed("raf_dist.ccl.allgather_start",
                  [](ffi::PackedArgs args, ffi::Any* rv) {
                    auto [g, call] = AllGatherCall(args);
                    *rv = StartCall(g, std::move(call));
                  })
      .def_packed("raf_dist.ccl.alltoall",
                  [](ffi::PackedArgs args, ffi::Any*) {
                    auto [g, call] = AllToAllCall(args);
                    RunCall(g, std::move(call));
                  })
      .def_packed("raf_dist.ccl.alltoall_start",
                  [](ffi::PackedArgs args, ffi::Any* rv) {
                    auto [g, call] = AllToAllCall(args);
                    *rv = StartCall(g, std::move(call));
                  })
      .def("raf_dist.ccl.broadcast",
           [](ffi::Tensor send, int64_t root, int64_t g, ffi::Tensor recv) {
             RunCall(g, BroadcastCall(send, root, recv));
           })
      .def("raf_dist.ccl.broadcast_start",
           [](ffi::Tensor send, int64_t root, int64_t g, ffi::Tensor recv) {
             return StartCall(g, BroadcastCall(send, root, recv));
           })
      .def("raf_dist.ccl.send",
           [](ffi::Tensor buf, int64_t peer, int64_t g) {
             RunCall(g, MakeCall(CollectiveKind::kSend, buf, std::nullopt,
                                 ReduceOp::kSum, static_cast<int>(peer)));
           })
      .def("raf_dist.ccl.send_start",
           [](ffi::Tensor buf, int64_t peer, int64_t g) {
             return StartCall(g, MakeCall(CollectiveKind::kSend, buf, std::nullopt,
                                          ReduceOp::kSum, static_cast<int>(peer)));
           })
      .def("raf_dist.ccl.recv",
           [](int64_t peer, int64_t g, ffi::Tensor buf) {
             RunCall(g, MakeCall(CollectiveKind::kRecv, std::nullopt, buf,
                                 ReduceOp::kSum, static_cast<int>(peer)));
           })
      .def("raf_dist.ccl.recv_start",
           [](int64_t peer, int64_t g, ffi::Tensor buf) {
             return StartCall(g, MakeCall(CollectiveKind::kRecv, std::nullopt, buf,
                                          ReduceOp::kSum, static_cast<int>(peer)));
           })
      .def("raf_dist.ccl.barrier",
           [](int64_t g) {
             RunCall(g, MakeCall(CollectiveKind::kBarrier, std::nullopt,
                                 std::nullopt));
           })
      .def_packed("raf_dist.ccl.wait",
                  [](ffi::PackedArgs args, ffi::Any* rv) {
                    if (args.size() < 1) {
                      TVM_FFI_THROW(TypeError) << "raf_dist.ccl.wait(handle, *buffers)";
                    }
                    WaitHandle(args[0].cast<int64_t>());
                  })
      .def("raf_dist.ccl.num_pending",
           []() -> int64_t {
             State& s = GetState();
             std::lock_guard<std::mutex> lock(s.mu);
             return static_cast<int64_t>(s.pending.size());
           })
      // ---- accounting ----
      // counters: every group's traffic; group_counters(g): group g's only.
      // reset_counters resets both; reset_group_counters(g) group g's only.
      .def("raf_dist.ccl.counters", []() { return CountersToMap(GlobalCounters()); })
      .def("raf_dist.ccl.group_counters",
           [](int64_t g) { return CountersToMap(GetGroup(g)->counters()); })
      .def("raf_dist.ccl.reset_counters",
           []() {
             GlobalCounters().Reset();
             State& s = GetState();
             std::lock_guard<std::mutex> lock(s.mu);
             for (auto& g : s.groups) {
               if (g) g->counters().Reset();
             }
           })
      .def("raf_dist.ccl.reset_group_counters",
           [](int64_t g) { GetGroup(g)->counters().Reset(); })
      .def("raf_dist.ccl.reinterpret", Reinterpret)
      .def("raf_dist.ccl.recent_collectives", []() { return ffi::String(RecentFlights()); })
      .def("raf_dist.ccl.nccl_enabled", []() {
#ifdef RAF_DIST_USE_NCCL
        return true;
#else
        return false;
#endif
      });
}

}  // namespace ccl
}  // namespace raf_dist
