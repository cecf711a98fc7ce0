"""``python -m raf_dist.run`` (console script ``raf_dist-run``): start this node's workers.

    python -m raf_dist.run --nproc-per-node 2 train.py --lr 1e-3
    python -m raf_dist.run --nnodes 2 --node-rank 0 --master-addr HOST --master-port 29500 \\
        --rdzv-token SECRET --nproc-per-node 4 train.py
    python -m raf_dist.run --nproc-per-node 2 --max-restarts 3 train.py

See ``raf_dist/launcher/`` and ``python -m raf_dist.run --help``.
"""
import logging
import sys
from typing import Optional, Sequence

from .launcher import Agent, LaunchError, parse


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs the launcher; returns its exit code (0, or the failing worker's code)."""
    logging.basicConfig(level=logging.WARNING, format="[raf_dist.run] %(message)s")
    try:
        config = parse(sys.argv[1:] if argv is None else argv)
    except LaunchError as err:
        sys.stderr.write(f"[raf_dist.run] {err}\n")
        return 2
    return Agent(config).run()


if __name__ == "__main__":
    sys.exit(main())
