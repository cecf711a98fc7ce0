/*!
 * \file device_memory.h
 * \brief Byte copies, fills and allocations on a tensor's device: memcpy/memset on the host,
 *        the CUDA runtime for GPU tensors in a build with NCCL — on TVM's compute stream,
 *        allocations stream-ordered from a pool that keeps freed memory for the next step.
 */
#ifndef RAF_DIST_CCL_DEVICE_MEMORY_H_
#define RAF_DIST_CCL_DEVICE_MEMORY_H_

#include <tvm/ffi/container/tensor.h>

#include <cstddef>

#include "collective.h"

namespace raf_dist {
namespace ccl {

namespace ffi = tvm::ffi;

/*! \brief Copy `bytes` from `src` to `dst`, both on `device` (`what` names the caller). */
void CopyBytes(DLDevice device, void* dst, const void* src, size_t bytes, const char* what);
/*! \brief Zero `bytes` at `dst` on `device`. */
void ZeroBytes(DLDevice device, void* dst, size_t bytes, const char* what);
/*! \brief A new contiguous tensor on `device` (64-byte aligned), contents undefined. */
ffi::Tensor EmptyTensor(ffi::ShapeView shape, DLDataType dtype, DLDevice device);
/*! \brief Bytes of one element of `dtype`. */
inline size_t ElemBytes(DLDataType dtype) { return (dtype.bits * dtype.lanes + 7) / 8; }
/*! \brief Write the flat padded dim-0 shard `s` of `t` (DESIGN.md section 3; ForEachShard
 *         says which elements) to `dst` on t's device: s.valid elements of t from s.begin,
 *         then zeros up to s.shard. Used by ZeRO's chunk packing and by local_shard. */
void CopyShard(const ffi::Tensor& t, const TensorShard& s, char* dst, const char* what);

}  // namespace ccl
}  // namespace raf_dist

#endif  // RAF_DIST_CCL_DEVICE_MEMORY_H_
