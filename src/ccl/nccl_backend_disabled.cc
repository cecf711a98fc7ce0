/*!
 * \file nccl_backend_disabled.cc
 * \brief Built instead of nccl_backend.cc when USE_NCCL is OFF: CUDA tensors get a clear error.
 */
#include "group.h"

namespace raf_dist {
namespace ccl {

std::unique_ptr<Backend> CreateNcclBackend(MPI_Comm, int) {
  TVM_FFI_THROW(RuntimeError) << "collective on a CUDA tensor, but libraf_dist was built without "
                                 "NCCL; rebuild with USE_CUDA and USE_NCCL ON in config.cmake "
                                 "(pip install -e .[cuda12] provides NCCL), or move the tensor "
                                 "to the host";
  return nullptr;
}

}  // namespace ccl
}  // namespace raf_dist
