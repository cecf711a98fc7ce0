/*!
 * \file shard.cc
 * \brief `raf_dist.ccl.local_shard`: this rank's flat, padded dim-0 shard of several tensors,
 *        packed back to back (DESIGN.md section 3).
 *
 *   local_shard(t_1, ..., t_k, group, out)
 *
 * Tensor t_i has n_i elements and shard size s_i = ceil(n_i / N) on a group of N ranks; rank r
 * owns elements [r * s_i, (r + 1) * s_i) of t_i flattened, the part past n_i being zero
 * padding. `out` (sum_i s_i elements) receives rank r's shard of t_1, then of t_2, and so on:
 * the same layout a reduce_scatter of the chunk-interleaved bucket leaves on rank r, so the
 * ZeRO passes can update a parameter shard against its gradient shard. The rank is read from
 * the group at run time, which keeps the compiled step identical on every rank (SPMD).
 */
#include <tvm/ffi/function.h>
#include <tvm/ffi/reflection/registry.h>

#include <utility>
#include <vector>

#include "device_memory.h"
#include "group.h"

namespace raf_dist {
namespace ccl {

int64_t GroupRank(int64_t group);
int64_t GroupSize(int64_t group);

namespace {

void LocalShard(ffi::PackedArgs args, ffi::Any* rv) {
  if (args.size() < 3) {
    TVM_FFI_THROW(TypeError) << "raf_dist.ccl.local_shard(t_1, ..., t_k, group, out)";
  }
  const int k = args.size() - 2;
  const int64_t group = args[k].cast<int64_t>();
  ffi::Tensor out = args[k + 1].cast<ffi::Tensor>();
  const int64_t rank = GroupRank(group), size = GroupSize(group);
  const DLDataType dtype = out.dtype();
  const size_t elem = ElemBytes(dtype);
  const int64_t out_numel = ContiguousNumel(out, "local_shard output");
  std::vector<ffi::Tensor> tensors;
  for (int i = 0; i < k; ++i) {
    ffi::Tensor t = args[i].cast<ffi::Tensor>();
    if (t.dtype() != dtype) {
      TVM_FFI_THROW(TypeError) << "local_shard: input " << i << " has dtype "
                               << ffi::DLDataTypeToString(t.dtype()) << ", output "
                               << ffi::DLDataTypeToString(dtype);
    }
    if (t.device().device_type != out.device().device_type) {
      TVM_FFI_THROW(ValueError) << "local_shard: input " << i << " and the output live on "
                                   "different devices";
    }
    ContiguousNumel(t, "local_shard input");  // raises unless contiguous
    tensors.push_back(std::move(t));
  }
  const int world = static_cast<int>(size);
  const int64_t shards = ShardBufferCount(tensors, world);
  if (shards != out_numel) {  // checked before any copy: a short output is never overrun
    TVM_FFI_THROW(ValueError) << "local_shard: output has " << out_numel << " elements, the "
                              << "shards fill " << shards << " (the sum of ceil(n_i / " << world
                              << ") over the " << k << " inputs)";
  }
  char* base = static_cast<char*>(DataPtr(out));
  ForEachShard(tensors, world, static_cast<int>(rank),
               [&](const ffi::Tensor& t, const TensorShard& s) {
                 CopyShard(t, s, base + s.offset * elem, "local_shard");
               });
}

}  // namespace

TVM_FFI_STATIC_INIT_BLOCK() {
  namespace refl = tvm::ffi::reflection;
  refl::GlobalDef().def_packed("raf_dist.ccl.local_shard", LocalShard);
}

}  // namespace ccl
}  // namespace raf_dist
