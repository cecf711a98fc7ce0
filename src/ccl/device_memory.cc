/*!
 * \file device_memory.cc
 * \brief See device_memory.h.
 */
#include "device_memory.h"

#include <cstdlib>
#include <cstring>

#ifdef RAF_DIST_USE_NCCL
#include <cuda_runtime.h>
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
struct CudaAlloc {
  void AllocData(DLTensor* t) {
    CheckCuda(cudaSetDevice(t->device.device_id), "cudaSetDevice", "EmptyTensor");
    CheckCuda(cudaMalloc(&t->data, ffi::GetDataSize(*t) == 0 ? 64 : ffi::GetDataSize(*t)),
              "cudaMalloc", "EmptyTensor");
  }
  void FreeData(DLTensor* t) { cudaFree(t->data); }
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
    CheckCuda(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, nullptr),
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
    CheckCuda(cudaMemsetAsync(dst, 0, bytes, nullptr), "cudaMemsetAsync", what);
    return;
  }
#endif
  Unsupported(device, what);
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
