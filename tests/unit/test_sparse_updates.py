"""The sparse table updates (runtime/embedding_update.py) against the dense update they stand
for, and the layouts row-wise Adagrad is refused under. A sharded table's step runs the sparse
functions on the looked-up rows (tests/distributed/test_embedding_parallel.py runs them in a
job); here each is checked alone, with duplicate ids, against the same optimizer's dense rule
on the scattered gradient (numpy, float64 reference)."""
import numpy as np
import pytest
import tvm
import tvm_ffi

import raf_dist
from models import make
from raf_dist.runtime import embedding_update  # noqa: F401  (registers the functions)

ROWS, DIM = 9, 4
IDS = np.array([3, 0, 3, 7, 3, 0], "int64")  # duplicates: their gradients add


def _tensors(*arrays):
    return [tvm.runtime.tensor(np.ascontiguousarray(a), tvm.cpu()) for a in arrays]


def _dense_gradient(rows):
    grad = np.zeros((ROWS, DIM))
    np.add.at(grad, IDS, rows)
    return grad


@pytest.mark.parametrize("row_wise", [True, False])
def test_adagrad_rows_equal_the_dense_update(row_wise):
    rng = np.random.default_rng(0)
    table = rng.standard_normal((ROWS, DIM)).astype("float32")
    total = rng.random((ROWS, 1) if row_wise else (ROWS, DIM)).astype("float32")
    rows = rng.standard_normal((IDS.size, DIM)).astype("float32")
    clr, eps = 0.05, 1e-10
    grad = _dense_gradient(rows)
    squares = (grad * grad).mean(axis=1, keepdims=True) if row_wise else grad * grad
    expected_sum = total + squares
    expected = table - clr * grad / (np.sqrt(expected_sum) + eps)

    t_table, t_sum, t_ids, t_rows, t_clr, t_eps, t_keep, t_row = _tensors(
        table, total, IDS, rows, np.float32(clr), np.float32(eps), np.bool_(True),
        np.bool_(row_wise))
    new_sum = tvm_ffi.get_global_func("raf_dist.embedding.adagrad_sum")(
        t_sum, t_ids, t_rows, t_keep, t_row)
    new_table = tvm_ffi.get_global_func("raf_dist.embedding.adagrad_rows")(
        t_table, new_sum, t_ids, t_rows, t_clr, t_eps, t_keep)
    np.testing.assert_allclose(new_sum.numpy(), expected_sum, rtol=1e-6)
    np.testing.assert_allclose(new_table.numpy(), expected, rtol=1e-6, atol=1e-7)
    untouched = np.setdiff1d(np.arange(ROWS), IDS)  # bit for bit as they were
    assert np.array_equal(new_table.numpy()[untouched], table[untouched])
    assert np.array_equal(new_sum.numpy()[untouched], total[untouched])
    assert np.shares_memory(np.from_dlpack(new_table), np.from_dlpack(t_table))  # in place


def test_rows_squares_are_the_dense_gradients():
    """Clipping a sparsely updated table counts the squares of the gradient its rows make
    (duplicates summed first), not of the rows."""
    rows = np.random.default_rng(1).standard_normal((IDS.size, DIM)).astype("float32")
    got = tvm_ffi.get_global_func("raf_dist.embedding.rows_squares")(*_tensors(IDS, rows))
    assert got.numpy().dtype == np.float32 and got.numpy().shape == ()
    np.testing.assert_allclose(got.numpy(), np.sum(_dense_gradient(rows) ** 2), rtol=1e-6)
    assert not np.isclose(got.numpy(), np.sum(rows.astype(np.float64) ** 2))


def test_a_skipped_step_changes_nothing():
    table, total = np.ones((ROWS, DIM), "float32"), np.ones((ROWS, 1), "float32")
    t_table, t_sum, t_ids, t_rows, t_clr, t_eps, t_keep, t_row = _tensors(
        table, total, IDS, np.ones((IDS.size, DIM), "float32"), np.float32(1),
        np.float32(0), np.bool_(False), np.bool_(True))
    tvm_ffi.get_global_func("raf_dist.embedding.adagrad_sum")(t_sum, t_ids, t_rows, t_keep,
                                                              t_row)
    tvm_ffi.get_global_func("raf_dist.embedding.adagrad_rows")(t_table, t_sum, t_ids, t_rows,
                                                               t_clr, t_eps, t_keep)
    assert np.array_equal(t_table.numpy(), table) and np.array_equal(t_sum.numpy(), total)


@pytest.mark.parametrize("fields, message", [
    ({"enable_data_parallel": True, "zero_opt_level": 1}, "zero_opt_level=1 shards"),
    ({"tensor_parallel_size": 2}, "tensor_parallel_size=2 splits"),
])
def test_row_wise_adagrad_is_refused_where_shards_cut_rows(dist_config, fields, message):
    module, x, _ = make("mlp", 4)
    model = raf_dist.frontend.from_pytorch(module, (x,))
    dist_config.update(fields)
    with pytest.raises(NotImplementedError, match=message):
        raf_dist.Trainer(model, optimizer=raf_dist.optim.RowWiseAdagrad())
