/*!
 * \file mpi_backend.h
 * \brief Host-tensor collectives over MPI, run in order on one communication thread per group
 *        so a compiled step can start a collective and keep computing until it waits.
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

#include "collective.h"

namespace raf_dist {
namespace ccl {

class MpiBackend : public Backend {
 public:
  explicit MpiBackend(MPI_Comm comm);
  ~MpiBackend() override;
  std::shared_ptr<Work> Start(CollectiveCall call) override;
  /*! \brief Finish queued work, stop the thread and free the communicator. Idempotent. */
  void Shutdown();
  int rank() const { return rank_; }
  int size() const { return size_; }

 private:
  void Loop();
  void Run(const CollectiveCall& call);

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 1;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Work>> queue_;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace ccl
}  // namespace raf_dist

#endif  // RAF_DIST_CCL_MPI_BACKEND_H_
