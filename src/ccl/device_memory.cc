/*!
 * \file device_memory.cc
 * \brief See device_memory.h.
 */
#include "device_memory.h"

#include "collective.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <vector>

#ifdef RAF_DIST_USE_NCCL
#include <cuda_runtime.h>
#include <tvm/ffi/extra/c_env_api.h>

#include <cstdint>
#include <mutex>
#endif

namespace raf_dist {
namespace ccl {

namespace {

bool OnHost(DLDevice device) {
  return device.device_type == kDLCPU || device.device_type == kDLCUDAHost;
}

[[noreturn]] void Unsupported(DLDevice device, const char* what) {
  TVM_FFI_THROW(ValueError) << what << ": device type " << static_cast<int>(device.device_type)
                            << " is not supported in this build (CPU always; CUDA with "
                               "USE_CUDA=ON USE_NCCL=ON)";
}

#ifdef RAF_DIST_USE_NCCL
void CheckCuda(cudaError_t err, const char* call, const char* what) {
  if (err != cudaSuccess) {
    TVM_FFI_THROW(RuntimeError) << what << ": " << call << ": " << cudaGetErrorString(err);
  }
}

/*! \brief The stream TVM's kernels run on for `device` (the legacy default stream unless the
 *         caller set another through TVM's environment), so copies stay ordered with them. */
cudaStream_t ComputeStream(int device) {
  return static_cast<cudaStream_t>(TVMFFIEnvGetStream(kDLCUDA, device));
}

/*! \brief Make the device's default memory pool keep freed blocks instead of returning them
 *         to the driver at every synchronisation: stream-ordered allocation then recycles a
 *         bucket's memory from one step to the next (as PyTorch's caching allocator does)
 *         instead of a cudaMalloc + cudaFree — which synchronises the whole device — per
 *         bucket per step. */
void RetainFreedMemory(int device) {
  static std::mutex mu;
  static std::vector<bool> done;
  std::lock_guard<std::mutex> lock(mu);
  if (static_cast<size_t>(device) < done.size() && done[device]) return;
  cudaMemPool_t pool;
  CheckCuda(cudaDeviceGetDefaultMemPool(&pool, device), "cudaDeviceGetDefaultMemPool",
            "EmptyTensor");
  uint64_t keep_all = UINT64_MAX;
  CheckCuda(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep_all),
            "cudaMemPoolSetAttribute", "EmptyTensor");
  if (done.size() <= static_cast<size_t>(device)) done.resize(device + 1, false);
  done[device] = true;
}
#endif

struct HostAlloc {
  void AllocData(DLTensor* t) {
    size_t bytes = ffi::GetDataSize(*t);
    size_t rounded = (bytes + 63) / 64 * 64;
    t->data = std::aligned_alloc(64, rounded == 0 ? 64 : rounded);
    if (t->data == nullptr) TVM_FFI_THROW(RuntimeError) << "out of host memory (" << bytes << " bytes)";
  }
  void FreeData(DLTensor* t) { std::free(t->data); }
};

#ifdef RAF_DIST_USE_NCCL
/*! \brief Stream-ordered allocation on the compute stream from the device's default pool
 *         (RetainFreedMemory). A tensor is freed on that stream, so its memory is reused only
 *         after the kernels queued before the free; a collective that reads it has made the
 *         compute stream wait for its completion event before the step drops the tensor. */
struct CudaAlloc {
  void AllocData(DLTensor* t) {
    const int device = t->device.device_id;
    CheckCuda(cudaSetDevice(device), "cudaSetDevice", "EmptyTensor");
    RetainFreedMemory(device);
    size_t bytes = ffi::GetDataSize(*t);
    CheckCuda(cudaMallocAsync(&t->data, bytes == 0 ? 64 : bytes, ComputeStream(device)),
              "cudaMallocAsync", "EmptyTensor");
  }
  void FreeData(DLTensor* t) {
    cudaSetDevice(t->device.device_id);
    cudaFreeAsync(t->data, ComputeStream(t->device.device_id));
  }
};
#endif

}  // namespace

void CopyBytes(DLDevice device, void* dst, const void* src, size_t bytes, const char* what) {
  if (bytes == 0 || dst == src) return;
  if (OnHost(device)) {
    std::memcpy(dst, src, bytes);
    return;
  }
#ifdef RAF_DIST_USE_NCCL
  if (device.device_type == kDLCUDA) {
    CheckCuda(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, ComputeStream(device.device_id)),
              "cudaMemcpyAsync", what);
    return;
  }
#endif
  Unsupported(device, what);
}

void ZeroBytes(DLDevice device, void* dst, size_t bytes, const char* what) {
  if (bytes == 0) return;
  if (OnHost(device)) {
    std::memset(dst, 0, bytes);
    return;
  }
#ifdef RAF_DIST_USE_NCCL
  if (device.device_type == kDLCUDA) {
    CheckCuda(cudaMemsetAsync(dst, 0, bytes, ComputeStream(device.device_id)), "cudaMemsetAsync", what);
    return;
  }
#endif
  Unsupported(device, what);
}

void CopyShard(const ffi::Tensor& t, const TensorShard& s, char* dst, const char* what) {
  const size_t elem = ElemBytes(t.dtype());
  const char* src = static_cast<const char*>(DataPtr(t));
  CopyBytes(t.device(), dst, src + s.begin * elem, s.valid * elem, what);
  ZeroBytes(t.device(), dst + s.valid * elem, (s.shard - s.valid) * elem, what);
}

ffi::Tensor EmptyTensor(ffi::ShapeView shape, DLDataType dtype, DLDevice device) {
  if (OnHost(device)) return ffi::Tensor::FromNDAlloc(HostAlloc(), shape, dtype, device);
#ifdef RAF_DIST_USE_NCCL
  if (device.device_type == kDLCUDA) return ffi::Tensor::FromNDAlloc(CudaAlloc(), shape, dtype, device);
#endif
  Unsupported(device, "EmptyTensor");
}

}  // namespace ccl
}  // namespace raf_dist
