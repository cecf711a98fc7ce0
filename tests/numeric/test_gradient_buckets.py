"""Gradients computed in their bucket train exactly like separate gradients (one process: the
data-parallel step's allreduce over a world of one is the identity), and the bucket runtime
(pack / view / copy_into) keeps its contract."""
import numpy as np
import pytest
import tvm_ffi

import raf_dist
from models import make, raf_optimizer, rel_err
from raf_dist import _native
from raf_dist.compiler.step_passes import step_passes
from raf_dist.runtime.spmd_build import SPMDBuilder


def _train(name, bucketed, monkeypatch, steps=3):
    module, x, y = make(name, 6)
    with monkeypatch.context() as m:
        if bucketed:  # the 2-rank data-parallel step, run by a world of one
            m.setattr(SPMDBuilder, "passes", lambda self, local=False: step_passes(
                0, 2, 600, overlap=self.plan.overlap_comm, group=self.comm.group))
        trainer = raf_dist.Trainer(raf_dist.frontend.from_pytorch(module, (x,)),
                                   optimizer=raf_optimizer("adamw"))
        return [trainer.step(x.numpy(), y.numpy()) for _ in range(steps)], trainer.state_dict()


@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer"])
def test_bucketed_step_trains_like_the_plain_step(name, monkeypatch):
    losses, params = _train(name, True, monkeypatch)
    ref_losses, ref_params = _train(name, False, monkeypatch)
    # The two steps fuse the gradients' producers differently (into the bucket's views vs
    # into the optimizer's kernels), so a gradient may differ in its last bit; AdamW turns a
    # last-bit difference on an element whose gradient is ~0 into a visible step (seen in
    # CI: one qkv.weight element of 768 off by 3e-6 relative after 3 steps). Hence a
    # norm-relative bound per tensor, 1e-6 (float32 ~1e-7 per step, 3 steps).
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    for key, value in ref_params.items():
        assert rel_err(params[key], value) <= 1e-6, (key, rel_err(params[key], value))


def _fn(name):
    _native.load()
    return tvm_ffi.get_global_func("raf_dist.bucket." + name)


def test_pack_places_gradients_at_their_offsets_and_zeroes_the_gaps():
    a = np.arange(5, dtype="float32")
    b = np.full((2, 3), 7, dtype="float32")
    bucket = np.from_dlpack(_fn("pack")(tvm_ffi.from_dlpack(a), tvm_ffi.from_dlpack(b),
                                        tvm_ffi.Shape([0, 16]), 22))
    np.testing.assert_array_equal(bucket, np.concatenate([a, np.zeros(11, "float32"), b.ravel()]))


def test_view_aliases_the_bucket_and_keeps_it_alive():
    base = np.full(40, 3, dtype="float64")
    bucket = tvm_ffi.from_dlpack(base)
    view = _fn("view")(bucket, 8, tvm_ffi.Shape([2, 3]), 2)
    assert np.from_dlpack(view).shape == (2, 3)
    np.from_dlpack(view)[:] = 5
    np.testing.assert_array_equal(base[8:14], 5)
    np.testing.assert_array_equal(base[14:16], 0)  # the pad after it is zeroed
    assert base[16] == 3
    del bucket
    assert np.from_dlpack(view).sum() == 30  # still readable: the view owns the bucket


def test_copy_into_and_bad_ranges():
    bucket = tvm_ffi.from_dlpack(np.zeros(32, dtype="float32"))
    _fn("copy_into")(tvm_ffi.from_dlpack(np.ones(3, "float32")), bucket, 16, 1)
    np.testing.assert_array_equal(np.from_dlpack(bucket)[15:20], [0, 1, 1, 1, 0])
    with pytest.raises(ValueError, match="not 64-byte aligned"):
        _fn("view")(bucket, 3, tvm_ffi.Shape([2]), 0)
    with pytest.raises(IndexError, match="do not fit a bucket of 32"):
        _fn("view")(bucket, 16, tvm_ffi.Shape([20]), 0)
    with pytest.raises(TypeError, match="dtype float64 differs"):
        _fn("copy_into")(tvm_ffi.from_dlpack(np.ones(3)), bucket, 0, 0)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_pack_chunks_interleaves_every_rank_s_shards(world):
    tensors = [np.arange(7, dtype="float32") + 1, np.arange(6, dtype="float32").reshape(2, 3) + 100,
               np.array([42.0], dtype="float32")]
    shards = [-(-t.size // world) for t in tensors]
    expected = []
    for r in range(world):  # chunk r: rank r's flat padded shard of each tensor in turn
        for t, s in zip(tensors, shards):
            piece = np.zeros(s, "float32")
            part = t.reshape(-1)[r * s:(r + 1) * s]
            piece[:part.size] = part
            expected.append(piece)
    packed = np.full(world * sum(shards), -1, "float32")  # every element gets written
    _fn("pack_chunks")(*[tvm_ffi.from_dlpack(t) for t in tensors], world, tvm_ffi.from_dlpack(packed))
    np.testing.assert_array_equal(packed, np.concatenate(expected))
