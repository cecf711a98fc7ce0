"""The seeds' workload proxies rebuilt from raf_dist's own compiled steps (issue #33).

- ``extract(model, MeshSpec(...))`` (extract.py): the collective sequence of the step every
  rank of that mesh runs, read from the IR after the distribution passes and the pipeline
  schedule, with the compute between collectives in FLOPs and bytes.
- ``replay`` (replay.py): that sequence through the native runtime under MPI, compute slept.
- ``simulate`` (simulate.py): the same on N virtual ranks of a described cluster.
- ``python -m raf_dist.proxies gpt2|gpt3|dlrm|cosmoflow``: the presets (presets.py).
"""
from .extract import MeshSpec, extract, function_events
from .simulate import CLUSTERS, Cluster, Link, load_cluster, simulate
from .workload import Event, Workload

__all__ = ["MeshSpec", "extract", "function_events", "CLUSTERS", "Cluster", "Link",
           "load_cluster", "simulate", "Event", "Workload"]
