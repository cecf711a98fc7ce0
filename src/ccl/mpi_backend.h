/*!
 * \file mpi_backend.h
 * \brief Host-tensor collectives over MPI, run in order on one communication thread per group
 *        so a compiled step can start a collective and keep computing until it waits.
 *
 * Collectives run to completion one after another in submission order (every rank submits
 * them in the same order, so they match). Sends and receives are posted and completed later.
 *
 * The communicator handed in is MPI_Comm_dup'ed: background collectives never interleave with
 * anything Python (mpi4py) does on the original. MPI must be initialised with
 * MPI_THREAD_MULTIPLE (mpi4py's default), checked at construction.
 */
#ifndef RAF_DIST_CCL_MPI_BACKEND_H_
#define RAF_DIST_CCL_MPI_BACKEND_H_

#include <mpi.h>

#include <deque>
#include <thread>
#include <vector>

#include "collective.h"

namespace raf_dist {
namespace ccl {

class MpiBackend : public Backend {
 public:
  explicit MpiBackend(MPI_Comm comm);
  ~MpiBackend() override;
  std::shared_ptr<Work> Start(CollectiveCall call) override;
  /*! \brief With RAF_DIST_COLLECTIVE_TIMEOUT_S (the default): through the communication
   *         thread, waited on with the deadline. Without: on the calling thread when nothing
   *         is queued or running (saves two thread hand-offs), else behind the pending work. */
  void RunBlocking(CollectiveCall call) override;
  /*! \brief Finish queued work, stop the thread and free the communicator. Idempotent. */
  void Shutdown();
  int rank() const { return rank_; }
  int size() const { return size_; }

 private:
  void Loop();
  /*! \brief Run a collective to completion, or post a send/recv and return its request. */
  MPI_Request Run(const CollectiveCall& call);
  /*! \brief Finish the posted sends/recvs that have completed. */
  void PollPointToPoint();

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 1;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Work>> queue_;
  bool stopping_ = false;
  bool busy_ = false;  // a collective is executing (on the thread or inline)
  std::thread thread_;
  // Sends and receives are posted (MPI_Isend/Irecv) rather than run to completion, so a rank
  // can post a recv and then a send on the one thread without deadlocking (rings, pipelines).
  std::vector<std::pair<MPI_Request, std::shared_ptr<Work>>> posted_;
};

}  // namespace ccl
}  // namespace raf_dist

#endif  // RAF_DIST_CCL_MPI_BACKEND_H_
