"""raf_dist.data.shard: each rank's rows of every global batch, from arrays or a loader."""
import numpy as np
import pytest
import torch

from raf_dist import data


def test_array_slices_cover_each_global_batch_once():
    x, y = np.arange(20).reshape(10, 2), np.arange(10)
    per_rank = [list(data.shard((x, y), 4, rank=r, world_size=2)) for r in range(2)]
    assert len(per_rank[0]) == 2 == data.num_steps(10, 4)  # 2 rows of the tail dropped
    for step in range(2):
        rows = np.concatenate([per_rank[r][step][1] for r in range(2)])
        np.testing.assert_array_equal(rows, np.arange(step * 4, step * 4 + 4))


def test_tail_padded_from_the_start_with_pad_last():
    y = np.arange(10)
    batches = [b for r in range(2) for b in data.shard(y, 4, drop_last=False, pad_last=True,
                                                       rank=r, world_size=2)]
    seen = np.concatenate(batches)
    assert set(seen) == set(range(10)) and len(seen) == 12


def test_uneven_tail_without_drop_last_repeats_no_row():
    x, y = np.arange(30).reshape(15, 2), np.arange(15)  # a global batch of 8 rows + 7 rows
    per_rank = [list(data.shard((x, y), 8, drop_last=False, rank=r, world_size=2))
                for r in range(2)]
    assert [len(p) for p in per_rank] == [2, 2] and data.num_steps(15, 8, drop_last=False) == 2
    assert [len(per_rank[r][1][1]) for r in range(2)] == [4, 3]  # the first rank takes more
    seen = np.concatenate([per_rank[r][s][1] for s in range(2) for r in range(2)])
    np.testing.assert_array_equal(seen, np.arange(15))  # every row once, in order
    np.testing.assert_array_equal(per_rank[1][1][0], x[12:15])


def test_tail_with_fewer_rows_than_ranks_is_refused():
    with pytest.raises(ValueError, match="the last global batch has 1 rows, fewer than the 2"):
        next(data.shard(np.arange(9), 4, drop_last=False, rank=0, world_size=2))


def test_loader_short_last_batch_split_unevenly():
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.arange(22.0).reshape(11, 2), torch.arange(11)),
        batch_size=4)
    got = [list(data.shard(loader, rank=r, world_size=2, drop_last=False)) for r in range(2)]
    assert len(got[0]) == len(got[1]) == 3
    np.testing.assert_array_equal(got[0][2][1], [8, 9])
    np.testing.assert_array_equal(got[1][2][1], [10])


def test_shuffle_is_the_same_permutation_on_every_rank():
    y = np.arange(16)
    parts = [np.concatenate(list(data.shard(y, 8, shuffle=True, seed=3, rank=r, world_size=4)))
             for r in range(4)]
    assert sorted(np.concatenate(parts)) == list(range(16))


def test_loader_of_global_batches():
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.arange(22.0).reshape(11, 2), torch.arange(11)),
        batch_size=4)
    got = list(data.shard(loader, rank=1, world_size=2))
    assert len(got) == 2  # the short last batch (3 rows) is skipped
    np.testing.assert_array_equal(got[0][1], [2, 3])
    assert isinstance(got[0][0], np.ndarray)


def test_errors():
    with pytest.raises(ValueError, match="must divide by the number of ranks"):
        next(data.shard(np.arange(10), 5, rank=0, world_size=2))
    with pytest.raises(ValueError, match="does not divide by 3"):
        next(data.shard([(np.arange(4),)], rank=0, world_size=3))


def test_each_seed_and_epoch_shuffles_differently():
    y = np.arange(64)

    def order(seed, epoch):
        return np.concatenate(list(data.shard(y, 8, shuffle=True, seed=seed, epoch=epoch,
                                              rank=0, world_size=1)))

    # seed + epoch would make (seed 1, epoch 0) and (seed 0, epoch 1) the same run
    assert not np.array_equal(order(1, 0), order(0, 1))
    assert np.array_equal(order(2, 3), order(2, 3))
