"""Bad input to embedding-table parallelism is refused on every rank before any exchange:

- an embedding_plan naming no table of the model, a rank outside the dp group, or given
  with row-wise sharding: ValueError at Trainer construction, naming the key / the rank;
- one rank's batch with an id outside its table: ValueError on every rank (naming the table
  and the id there, the rank elsewhere), before any all-to-all (the native counters show
  none); ranks with different rows: ValueError on every rank; the Trainer then trains on a
  good batch as if nothing happened (nothing lost, nothing hung);
- predict() with a bad id, or other rows on one rank (another count, or as many rows with
  other values): ValueError on every rank before any exchange; then predict() on good rows
  runs.
Prints 'rank R: refused: <message>' per case and 'rank R: EP ERRORS OK'."""
import sys

import raf_dist
from raf_dist import distributed as dist
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
from models import make_sharded_rec, raf_optimizer  # noqa: E402


def refused(build, expect):
    try:
        build()
    except ValueError as err:
        assert expect in str(err), (expect, str(err))
        print(f"rank {dist.get_communicator().rank}: refused: {err}")
        return
    raise AssertionError(f"not refused: {expect}")


def main():
    comm = dist.get_communicator()
    config = dist.get_config()
    config.update({"enable_data_parallel": True, "embedding_parallel": "table"})
    module, x, y = make_sharded_rec(4 * comm.size)
    rows = slice(comm.rank * 4, comm.rank * 4 + 4)
    xs, ys = [a[rows].numpy() for a in x], y[rows].numpy()
    model = raf_dist.frontend.from_pytorch(module, tuple(a[rows] for a in x))

    def trainer(plan=None):
        return raf_dist.Trainer(model, optimizer=raf_optimizer("adamw"), embedding_plan=plan)

    refused(lambda: trainer({"tables.9": 0}), "'tables.9', which is no embedding table")
    refused(lambda: trainer({"tables.1": comm.size}),
            f"outside the data-parallel group of {comm.size} ranks")
    config.embedding_parallel = "row"
    refused(lambda: trainer({"tables.1": 0}), "needs dist.get_config().embedding_parallel = "
                                              "'table'")
    config.embedding_parallel = "table"
    good = trainer({"tables.1": comm.size - 1})
    bad = [a.copy() for a in xs]
    last = comm.size - 1
    if comm.rank == last:  # one rank's batch only: every rank raises, none waits
        bad[1][0, 1, 2] = 60  # table 1 has 60 rows
    dist.reset_comm_counters()
    refused(lambda: good.step(bad, ys),
            "'tables.1.weight' has 60 rows and was asked for row 60" if comm.rank == last
            else f"the batch of rank(s) [{last}] has an id outside its embedding table")
    # ranks with different rows: the exchanges' sizes are compiled in
    short = [a[:3] for a in xs] if comm.rank == 0 else xs
    refused(lambda: good.step(short, ys[:3] if comm.rank == 0 else ys),
            "embedding_parallel with different rows per rank")
    assert dist.comm_counters().get("alltoall", {"calls": 0})["calls"] == 0
    loss = good.step(xs, ys)
    assert loss == loss and good.step_count == 1, loss
    assert dist.comm_counters()["alltoall"]["calls"] > 0
    # predict: every rank passes the same rows, each computes a share of them. A bad id
    # and ranks with other rows are refused on every rank before any exchange
    calls = dist.comm_counters()["alltoall"]["calls"]
    every = [a.numpy() for a in x]
    wrong = [a.copy() for a in every]
    wrong[1][-1, 1, 0] = -1
    refused(lambda: good.predict(wrong), "'tables.1.weight' has 60 rows and was asked for row -1")
    refused(lambda: good.predict([a[:5] for a in every] if comm.rank == 0 else every),
            f"got other rows on other ranks ([5, {4 * comm.size}")
    other = [a.copy() for a in every]
    other[0][0, 0] += 1.0  # as many rows, other values: the ranks' checksums differ
    refused(lambda: good.predict(other if comm.rank == 0 else every), "2 different contents")
    assert dist.comm_counters()["alltoall"]["calls"] == calls
    assert good.predict(every).shape == (4 * comm.size, 2)
    print(f"rank {comm.rank}: EP ERRORS OK")


if __name__ == "__main__":
    main()
