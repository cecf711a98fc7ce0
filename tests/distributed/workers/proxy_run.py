"""``python -m raf_dist.proxies ARGS`` as a worker script (tests/mpi_launch.py runs scripts):
the replay of a preset's communication under mpirun."""
import sys

from raf_dist.proxies.__main__ import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
