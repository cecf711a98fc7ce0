/*!
 * \file group.h
 * \brief A process group: validates each collective before anything is sent, counts its bus
 *        bytes, optionally cross-checks its signature with every rank, then hands it to the
 *        backend for the tensors' device (MPI for host memory, NCCL for CUDA memory).
 */
#ifndef RAF_DIST_CCL_GROUP_H_
#define RAF_DIST_CCL_GROUP_H_

#include <mpi.h>

#include <array>
#include <atomic>

#include "collective.h"
#include "mpi_backend.h"

namespace raf_dist {
namespace ccl {

/*! \brief Per-kind traffic, counted as nccl-tests counts bus bytes. One process-wide instance
 *         (GlobalCounters) sums every group; each Group also keeps its own. */
struct Counters {
  std::array<std::atomic<int64_t>, static_cast<int>(CollectiveKind::kNumKinds)> calls{};
  std::array<std::atomic<double>, static_cast<int>(CollectiveKind::kNumKinds)> bus_bytes{};
  void Add(CollectiveKind kind, double bytes);
  void Reset();
};
Counters& GlobalCounters();

/*! \brief Creates the NCCL backend (nccl_backend.cc), or raises when built without NCCL. */
std::unique_ptr<Backend> CreateNcclBackend(MPI_Comm comm, int device_id);

class Group {
 public:
  Group(MPI_Comm comm, bool check_signatures);
  ~Group();
  /*! \brief Validate, count, check and start the call. Raises before any communication on
   *         bad input, so one rank's mistake never leaves the others waiting. */
  std::shared_ptr<Work> Start(CollectiveCall call);
  /*! \brief Start + wait, without a thread hand-off when the backend is idle. */
  void Run(CollectiveCall call);
  void Shutdown();
  int rank() const { return rank_; }
  /*! \brief The group's id in the registry (what the flight recorder names). */
  void set_id(int64_t id) { id_ = id; }
  int size() const { return size_; }
  /*! \brief This group's traffic only (GlobalCounters() has every group's). */
  Counters& counters() { return counters_; }

 private:
  void Validate(CollectiveCall* call) const;
  /*! \brief Validate a reduce_scatter / allgather of several full tensors (`parts`). */
  void ValidateParts(CollectiveCall* call) const;
  /*! \brief Validate an alltoall's counts and splits (collective.h). */
  void ValidateAllToAll(const CollectiveCall& call) const;
  void CheckSignature(const CollectiveCall& call);
  /*! \brief Under the signature check: every rank's alltoallv splits pair up. */
  void CheckSplits(const CollectiveCall& call);
  Backend* BackendFor(const CollectiveCall& call);
  /*! \brief Validate, pick the backend, check the signature and count: everything that
   *         happens before a collective is handed to its backend. */
  Backend* Prepare(CollectiveCall* call);

  MPI_Comm check_comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 1;
  bool check_signatures_;
  int64_t sequence_ = 0;
  int64_t id_ = -1;
  std::mutex mu_;
  std::unique_ptr<MpiBackend> mpi_;
  MPI_Comm nccl_bootstrap_comm_ = MPI_COMM_NULL;
  std::unique_ptr<Backend> nccl_;
  int nccl_device_ = -1;
  Counters counters_;
};

}  // namespace ccl
}  // namespace raf_dist

#endif  // RAF_DIST_CCL_GROUP_H_
