/*!
 * \file bucket.cc
 * \brief Gradient buckets as one buffer that gradients live in (DESIGN.md section 2):
 *
 *   raf_dist.bucket.pack(g_1, ..., g_k, offsets, total) -> bucket
 *       a new [total] buffer with g_i's elements at element offset offsets[i] and zeros in
 *       the gaps between them (the portable form the data-parallel pass emits);
 *   raf_dist.bucket.view(bucket, offset, shape, pad) -> tensor
 *       a zero-copy tensor of `shape` on the bucket's elements from `offset`, that keeps the
 *       bucket alive; `pad` elements after it are zeroed (the gap to the next gradient). The
 *       view's data pointer points into the bucket and its byte_offset is 0, so TVM's kernels
 *       (which require byte_offset == 0) and BLAS write into it directly;
 *   raf_dist.bucket.copy_into(src, bucket, offset, pad)
 *       copy src into the bucket at `offset`, zero `pad` elements after it;
 *   raf_dist.bucket.empty(like, total, dtype) -> bucket
 *       a new [total] buffer of `dtype` on `like`'s device, contents undefined;
 *   raf_dist.arena.view(arena, byte_offset, shape, dtype) -> tensor
 *       a zero-copy tensor of `shape` and `dtype` at `byte_offset` bytes into a planned
 *       step's arena (a [bytes] uint8 tensor, compiler/share_storage.py), keeping the arena
 *       alive; byte_offset 0 in the DLTensor, as the bucket's views (TVM's own
 *       `R.memory.view` sets the DLTensor's byte_offset, which the kernels reject, and
 *       `ensure_zero_offset` after it would be a second call per tensor and step);
 *   raf_dist.bucket.pack_chunks(t_1, ..., t_k, N, out)
 *       fills `out`, ZeRO's chunk-interleaved [N * S] buffer (DESIGN.md section 3): chunk r
 *       holds rank r's flat padded dim-0 shard (s_i = ceil(n_i / N) elements, zeros past n_i)
 *       of t_1, then of t_2, ...; S = sum s_i. One reduce_scatter of it leaves every rank its
 *       shards. Destination-passing, so the memory planner places `out` like any temporary.
 *       No pass emits it any more: ShardZeRO reduce-scatters a bucket's gradients where they
 *       live (raf_dist.ccl.reduce_scatter of several tensors, collective.h), which leaves the
 *       same shards without this [N * S] copy.
 *   raf_dist.bucket.concat(t_1, ..., t_k, out)
 *       fills `out` with t_1's elements, then t_2's, ... (contiguous, one dtype and device):
 *       ZeRO-3's per-parameter shards into a bucket's flat [S] send buffer for its
 *       allgathers, one copy per tensor. Destination-passing. TVM's `concat` of k tensors
 *       legalises to one kernel whose every element walks a k-way select chain: 6 ms for the
 *       54 shards (1.9 MB) of bench/step_time.py's GPT on this CPU, where these copies take
 *       a few hundredths of that.
 *
 * Before memory planning, compiler/inplace_buckets.py turns every pack whose gradients it can
 * trace to their allocation into `empty` plus views: the kernels that compute the gradients
 * write them into the bucket, no copy remains, and the planner never allocates them. Offsets are multiples of 64
 * bytes: generated kernels assume aligned data (a misaligned view crashes them).
 */
#include <tvm/ffi/function.h>
#include <tvm/ffi/reflection/registry.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "collective.h"
#include "device_memory.h"

namespace raf_dist {
namespace ccl {

namespace {

/*! \brief Data of a view: a pointer into the base tensor, which it keeps alive. */
struct ViewAlloc {
  ffi::Tensor base;
  size_t byte_offset;
  void AllocData(DLTensor* t) { t->data = static_cast<char*>(DataPtr(base)) + byte_offset; }
  void FreeData(DLTensor*) {}
};

void CheckRange(const ffi::Tensor& bucket, int64_t offset, int64_t numel, int64_t pad,
                const char* what) {
  const int64_t total = ContiguousNumel(bucket, what);
  if (offset < 0 || numel < 0 || pad < 0 || offset + numel + pad > total) {
    TVM_FFI_THROW(IndexError) << what << ": elements [" << offset << ", " << offset + numel + pad
                              << ") do not fit a bucket of " << total << " elements";
  }
  if ((offset * ElemBytes(bucket.dtype())) % 64 != 0) {
    TVM_FFI_THROW(ValueError) << what << ": offset " << offset
                              << " is not 64-byte aligned; compiled kernels need aligned data";
  }
}

ffi::Tensor ArenaView(ffi::Tensor arena, int64_t byte_offset, ffi::Shape shape,
                      ffi::String dtype_name) {
  const DLDataType dtype = ffi::StringToDLDataType(dtype_name);
  int64_t numel = 1;
  for (int64_t d : shape) numel *= d;
  const int64_t bytes = ContiguousNumel(arena, "raf_dist.arena.view") * ElemBytes(arena.dtype());
  const int64_t size = numel * static_cast<int64_t>(ElemBytes(dtype));
  if (byte_offset < 0 || numel < 0 || byte_offset + size > bytes) {
    TVM_FFI_THROW(IndexError) << "raf_dist.arena.view: bytes [" << byte_offset << ", "
                              << byte_offset + size << ") do not fit an arena of " << bytes
                              << " bytes";
  }
  if (byte_offset % 64 != 0) {
    TVM_FFI_THROW(ValueError) << "raf_dist.arena.view: offset " << byte_offset
                              << " is not 64-byte aligned; compiled kernels need aligned data";
  }
  DLDevice device = arena.device();
  return ffi::Tensor::FromNDAlloc(ViewAlloc{std::move(arena), static_cast<size_t>(byte_offset)},
                                  shape, dtype, device);
}

ffi::Tensor View(ffi::Tensor bucket, int64_t offset, ffi::Shape shape, int64_t pad) {
  int64_t numel = 1;
  for (int64_t d : shape) numel *= d;
  CheckRange(bucket, offset, numel, pad, "raf_dist.bucket.view");
  const size_t elem = ElemBytes(bucket.dtype());
  ZeroBytes(bucket.device(), static_cast<char*>(DataPtr(bucket)) + (offset + numel) * elem,
            pad * elem, "raf_dist.bucket.view");
  DLDataType dtype = bucket.dtype();
  DLDevice device = bucket.device();
  return ffi::Tensor::FromNDAlloc(ViewAlloc{std::move(bucket), offset * elem}, shape, dtype,
                                  device);
}

void CopyInto(const ffi::Tensor& src, const ffi::Tensor& bucket, int64_t offset, int64_t pad,
              const char* what) {
  if (src.dtype() != bucket.dtype()) {
    TVM_FFI_THROW(TypeError) << what << ": gradient dtype " << ffi::DLDataTypeToString(src.dtype())
                             << " differs from the bucket's "
                             << ffi::DLDataTypeToString(bucket.dtype());
  }
  if (src.device().device_type != bucket.device().device_type) {
    TVM_FFI_THROW(ValueError) << what << ": gradient and bucket live on different devices";
  }
  const int64_t numel = ContiguousNumel(src, what);
  CheckRange(bucket, offset, numel, pad, what);
  const size_t elem = ElemBytes(bucket.dtype());
  char* dst = static_cast<char*>(DataPtr(bucket)) + offset * elem;
  CopyBytes(bucket.device(), dst, DataPtr(src), numel * elem, what);
  ZeroBytes(bucket.device(), dst + numel * elem, pad * elem, what);
}

void Pack(ffi::PackedArgs args, ffi::Any* rv) {
  if (args.size() < 3) {
    TVM_FFI_THROW(TypeError) << "raf_dist.bucket.pack(g_1, ..., g_k, offsets, total)";
  }
  const int k = args.size() - 2;
  ffi::Shape offsets = args[k].cast<ffi::Shape>();
  const int64_t total = args[k + 1].cast<int64_t>();
  if (static_cast<int>(offsets.size()) != k) {
    TVM_FFI_THROW(ValueError) << "raf_dist.bucket.pack: " << k << " gradients but "
                              << offsets.size() << " offsets";
  }
  ffi::Tensor first = args[0].cast<ffi::Tensor>();
  ffi::Tensor bucket = EmptyTensor(ffi::Shape({total}), first.dtype(), first.device());
  for (int i = 0; i < k; ++i) {
    ffi::Tensor g = args[i].cast<ffi::Tensor>();
    const int64_t end = i + 1 < k ? offsets[i + 1] : total;
    CopyInto(g, bucket, offsets[i], end - offsets[i] - g.numel(), "raf_dist.bucket.pack");
  }
  *rv = bucket;
}

void PackChunks(ffi::PackedArgs args, ffi::Any* rv) {
  if (args.size() < 3) {
    TVM_FFI_THROW(TypeError) << "raf_dist.bucket.pack_chunks(t_1, ..., t_k, N, out)";
  }
  const int k = args.size() - 2;
  const int64_t n = args[k].cast<int64_t>();
  ffi::Tensor out = args[k + 1].cast<ffi::Tensor>();
  if (n < 1) TVM_FFI_THROW(ValueError) << "raf_dist.bucket.pack_chunks: N must be >= 1, got " << n;
  std::vector<ffi::Tensor> tensors;
  for (int i = 0; i < k; ++i) {
    tensors.push_back(args[i].cast<ffi::Tensor>());
    const ffi::Tensor& t = tensors.back();
    if (t.dtype() != tensors[0].dtype() || t.device().device_type != tensors[0].device().device_type) {
      TVM_FFI_THROW(TypeError) << "raf_dist.bucket.pack_chunks: tensor " << i
                               << " differs in dtype or device from tensor 0";
    }
    ContiguousNumel(t, "raf_dist.bucket.pack_chunks");  // raises unless contiguous
  }
  const int world = static_cast<int>(n);
  const int64_t shard_total = ShardBufferCount(tensors, world);
  if (ContiguousNumel(out, "raf_dist.bucket.pack_chunks output") != n * shard_total ||
      out.dtype() != tensors[0].dtype()) {
    TVM_FFI_THROW(ValueError) << "raf_dist.bucket.pack_chunks: output must be " << n * shard_total
                              << " elements of the inputs' dtype";
  }
  const size_t elem = ElemBytes(out.dtype());
  char* base = static_cast<char*>(DataPtr(out));
  for (int r = 0; r < world; ++r) {  // chunk r: rank r's shard buffer
    char* chunk = base + r * shard_total * elem;
    ForEachShard(tensors, world, r, [&](const ffi::Tensor& t, const TensorShard& s) {
      CopyShard(t, s, chunk + s.offset * elem, "pack_chunks");
    });
  }
}

void Concat(ffi::PackedArgs args, ffi::Any*) {
  if (args.size() < 2) {
    TVM_FFI_THROW(TypeError) << "raf_dist.bucket.concat(t_1, ..., t_k, out)";
  }
  const int k = args.size() - 1;
  ffi::Tensor out = args[k].cast<ffi::Tensor>();
  const int64_t total = ContiguousNumel(out, "raf_dist.bucket.concat output");
  int64_t offset = 0;
  for (int i = 0; i < k; ++i) {
    ffi::Tensor t = args[i].cast<ffi::Tensor>();
    const int64_t numel = ContiguousNumel(t, "raf_dist.bucket.concat");
    if (offset + numel > total) {
      TVM_FFI_THROW(ValueError) << "raf_dist.bucket.concat: the inputs hold more than the "
                                << total << " elements of the output";
    }
    if (t.dtype() != out.dtype() || t.device().device_type != out.device().device_type ||
        t.device().device_id != out.device().device_id) {
      TVM_FFI_THROW(TypeError) << "raf_dist.bucket.concat: tensor " << i
                               << " differs in dtype or device from the output";
    }
    // a plain copy at any element offset (CopyInto's 64-byte rule is for views)
    const size_t elem = ElemBytes(out.dtype());
    CopyBytes(out.device(), static_cast<char*>(DataPtr(out)) + offset * elem, DataPtr(t),
              numel * elem, "raf_dist.bucket.concat");
    offset += numel;
  }
  if (offset != total) {
    TVM_FFI_THROW(ValueError) << "raf_dist.bucket.concat: the inputs hold " << offset
                              << " elements, the output " << total;
  }
}

}  // namespace

TVM_FFI_STATIC_INIT_BLOCK() {
  namespace refl = tvm::ffi::reflection;
  refl::GlobalDef()
      .def_packed("raf_dist.bucket.pack", Pack)
      .def_packed("raf_dist.bucket.pack_chunks", PackChunks)
      .def_packed("raf_dist.bucket.concat", Concat)
      .def("raf_dist.bucket.view", View)
      .def("raf_dist.arena.view", ArenaView)
      .def("raf_dist.bucket.copy_into",
           [](ffi::Tensor src, ffi::Tensor bucket, int64_t offset, int64_t pad) {
             CopyInto(src, bucket, offset, pad, "raf_dist.bucket.copy_into");
           })
      .def("raf_dist.bucket.empty", [](ffi::Tensor like, int64_t total, ffi::String dtype) {
        return EmptyTensor(ffi::Shape({total}), ffi::StringToDLDataType(dtype), like.device());
      });
}

}  // namespace ccl
}  // namespace raf_dist
