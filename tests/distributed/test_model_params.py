"""Distributed tier for tied parameters: a model whose head is its token embedding (GPT-2's
tying) trains on 2 ranks under plain data parallelism and ZeRO-3 exactly as one process on the
global batch (workers/tied_train.py). One mpiexec run checks both levels."""
import re

from mpi_launch import check_mpi


def test_tied_weights_under_data_parallel_and_zero3_match_one_process():
    out = check_mpi("tied_train.py", 2, "0,3", timeout=360)
    oks = re.findall(r"rank (\d+): ALL OK", out)
    assert sorted(int(r) for r in oks) == [0, 1], out
