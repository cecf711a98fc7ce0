"""The seeds' workloads (spcl/DNN-cpp-proxies), as raf_dist models and meshes, with the
message sizes the C++ proxies hard-code, to print beside the extracted ones.

What the C++ proxies do (read from their sources; floats are 4 bytes):
- ``gpt2`` (gpt2_large.cpp): 48 layers over 4 stages, 8 microbatches of one 632-token sequence,
  hidden 1280; per microbatch an 808,960-float message each way between stages; per stage an
  allreduce of 19,677,440 floats per layer across the dp replicas (84,006,400 for the layers
  holding the tied 50257 x 1280 token embedding); no compute.
- ``gpt3`` (gpt3.cpp): 96 layers = 96 stages, 4-way tensor parallelism, 2 x stages
  microbatches of one 2048-token sequence, hidden 12288; 25,165,824-float messages between
  stages and two tp allreduces of that size per layer forward, two backward; one dp allreduce
  of 452,984,832 floats (a layer's 12 h^2 over 4 tp ranks) per iteration; compute slept
  (15,915 us forward, 31,830 us backward per microbatch, measured on A100). Its loop runs all
  forwards, then all backwards (it prints "1F1B").
- ``dlrm`` (dlrm.cpp, after dlrm_s_pytorch.py --arch-embedding-size=80000-80000-80000-80000
  --arch-sparse-feature-size=128 --arch-mlp-bot=128-128-128-128
  --arch-mlp-top=512-512-512-256-1 --mini-batch-size=2048 on 4 ranks): an all-to-all of
  262,144 floats forward and one backward; non-blocking allreduces of the top MLP's 728,065
  and the bottom MLP's 49,536 gradient floats; compute slept.
- ``cosmoflow`` (cosmoflow.cpp): 4-way spatial parallelism of 3-D convolutions (halo exchange
  with the neighbours), dense layers by allgather forward and reduce-scatter backward, six
  gradient allreduces progressed by MPI_Testany. raf_dist has no spatial parallelism: this
  one is replayed from its description (``cosmoflow_workload``), not extracted.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from .extract import MeshSpec
from .workload import Event, Workload

FLOAT = 4


@dataclasses.dataclass
class Preset:
    name: str
    build: Callable  # (args) -> (Model, MeshSpec, loss)
    spcl: Callable  # (args) -> [(what, floats, count per iteration per rank)]
    defaults: dict


def _gpt2(a):
    from . import models

    layers, stages = a.layers or 48, a.stages or 4
    micro = a.microbatches or 8
    hidden, seq, vocab = 1280, 632, a.vocab or 50257
    model = models.gpt(layers, hidden, 20, seq, vocab, micro * a.micro_batch)
    per_layer = 12 * hidden * hidden + 13 * hidden
    mesh = MeshSpec(dp=a.dp, tp=a.tp or 1, pp=stages, microbatches=micro,
                    schedule=a.schedule, zero=a.zero, recompute=a.recompute,
                    bucket_mb=a.bucket_mb or per_layer * FLOAT / 2**20)
    return model, mesh, "cross_entropy"


def _gpt2_spcl(a):
    layers, stages = a.layers or 48, a.stages or 4
    micro = a.microbatches or 8
    per_layer, embedding = 19_677_440, 84_006_400
    return [("p2p activation / gradient per microbatch", 632 * 1280, 2 * micro),
            ("dp allreduce per layer", per_layer, layers // stages),
            ("dp allreduce of a layer with the embedding (first/last stage)", embedding, 1)]


def _gpt3(a):
    from . import models

    layers = a.layers or 96
    stages = a.stages or layers
    micro = a.microbatches or 2 * stages
    hidden, seq, vocab = 12288, 2048, a.vocab or 50257
    model = models.gpt(layers, hidden, 96, seq, vocab, micro * a.micro_batch)
    mesh = MeshSpec(dp=a.dp, tp=a.tp or 4, pp=stages, microbatches=micro,
                    schedule=a.schedule, zero=a.zero, recompute=a.recompute,
                    bucket_mb=a.bucket_mb or 25.0)
    return model, mesh, "cross_entropy"


def _gpt3_spcl(a):
    layers = a.layers or 96
    stages = a.stages or layers
    micro = a.microbatches or 2 * stages
    return [("p2p activation / gradient per microbatch", 2048 * 12288, 2 * micro),
            ("tp allreduce (2 forward + 2 backward per layer per microbatch)", 2048 * 12288,
             4 * micro * layers // stages),
            ("dp allreduce per iteration (a stage's 12 h^2 / tp)", 452_984_832, 1)]


def _dlrm(a):
    from . import models

    ranks = a.dp
    model = models.dlrm(2048 // ranks if not a.micro_batch_set else a.micro_batch, 128,
                        [128, 128, 128], [80000] * 4, 128, [512, 512, 512, 256, 1])
    mesh = MeshSpec(dp=ranks, tp=a.tp or 1, embedding_parallel=a.embedding_parallel or "table",
                    bucket_mb=a.bucket_mb or 25.0, zero=a.zero)
    return model, mesh, "mse"


def _dlrm_spcl(a):
    return [("all-to-all of the pooled rows (forward, backward)", 262_144, 2),
            ("top MLP gradient allreduce", 728_065, 1),
            ("bottom MLP gradient allreduce", 49_536, 1)]


def cosmoflow_workload(dp: int, spatial: int = 4, microbatch: int = 1) -> Workload:
    """CosmoFlow's communication from the seeds' description (raf_dist has no spatial
    parallelism to extract it from): per sample, five 3-D convolutions on a 128^3 x 4 input
    split in ``spatial`` slabs along depth, each exchanging one halo plane with each
    neighbour; three dense layers whose input is allgathered forward and whose gradient is
    reduce-scattered backward over the spatial group; the six layers' gradients allreduced
    over the dp replicas, started as each is ready and waited at the end."""
    channels = [4, 32, 64, 128, 256, 256]
    side = [128, 64, 32, 16, 8, 4]
    conv_params = [3 ** 3 * channels[i] * channels[i + 1] + channels[i + 1] for i in range(5)]
    dense = [(256 * 4 ** 3 // spatial * spatial, 128), (128, 64), (64, 4)]
    events: list[Event] = []
    flops_conv = [2 * 27 * channels[i] * channels[i + 1] * side[i] ** 3 // spatial * microbatch
                  for i in range(5)]
    for i in range(5):  # forward: halo planes to both neighbours, then the convolution
        plane = side[i] ** 2 * channels[i] * microbatch * FLOAT
        events += [Event("allgather", bytes=2 * plane * spatial, axis="tp",
                         what=f"conv{i} halo")]
        events.append(Event("compute", flops=flops_conv[i], what=f"conv{i} forward"))
    for j, (fan_in, fan_out) in enumerate(dense):
        events.append(Event("allgather", bytes=fan_in * microbatch * FLOAT, axis="tp",
                            what=f"dense{j} input"))
        events.append(Event("compute", flops=2 * fan_in * fan_out * microbatch,
                            what=f"dense{j} forward"))
    handle = 0
    for j, (fan_in, fan_out) in reversed(list(enumerate(dense))):
        events.append(Event("compute", flops=4 * fan_in * fan_out * microbatch,
                            what=f"dense{j} backward"))
        events.append(Event("reduce_scatter", bytes=fan_in * microbatch * FLOAT, axis="tp",
                            what=f"dense{j} input gradient"))
    for i in reversed(range(5)):
        plane = side[i] ** 2 * channels[i + 1] * microbatch * FLOAT
        events.append(Event("allgather", bytes=2 * plane * spatial, axis="tp",
                            what=f"conv{i} halo gradient"))
        events.append(Event("compute", flops=2 * flops_conv[i], what=f"conv{i} backward"))
        # six gradient allreduces in all (five convolutions, the dense layers together),
        # started as each is ready
        events.append(Event("allreduce", bytes=conv_params[i] * FLOAT, axis="dp",
                            handle=handle, what=f"conv{i} gradient"))
        handle += 1
    events.append(Event("allreduce", bytes=sum(fi * fo + fo for fi, fo in dense) * FLOAT,
                        axis="dp", handle=handle, what="dense gradients"))
    handle += 1
    events += [Event("wait", handle=h, what="gradients") for h in range(handle)]
    return Workload("cosmoflow", dp, spatial, 1, 0, 1, "none", [events],
                    source="described after spcl/DNN-cpp-proxies cosmoflow.cpp (halo "
                           "exchanges modelled as allgathers over the spatial group)")


PRESETS = {
    "gpt2": Preset("gpt2", _gpt2, _gpt2_spcl, {}),
    "gpt3": Preset("gpt3", _gpt3, _gpt3_spcl, {}),
    "dlrm": Preset("dlrm", _dlrm, _dlrm_spcl, {}),
}
WORKLOADS = ("gpt2", "gpt3", "dlrm", "cosmoflow")
