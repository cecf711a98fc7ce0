"""What the ranks of one job check together before their first collective: the parallelism
they asked for, then everything a Trainer is built from, then the compiled step's
fingerprint. A mismatch is one ValueError naming the difference on every rank instead of
unrelated failures (or a hang) in the collectives that follow."""
import hashlib
import json
from typing import Any, Dict, List, Tuple

import tvm

from .. import device as device_lib
from .._version import __version__
from ..distributed.communicator import raised_on_every_rank
from .plan import PARALLELISM_FIELDS, RunPlan


def agree(comm: Any, plan: RunPlan, model: Any, loss: str, optimizer: Any, device: str,
          embedding_plan: Any = None) -> None:
    """Before its first collective (the mesh's splits, the device check, the parameter
    broadcast) a Trainer in a world of several ranks meets every rank, whatever its own
    config asks for: a barrier with a timeout whose error names the ranks that never came,
    then every rank's parallelism settings compared (a rank with data parallelism off would
    otherwise train alone and leave the others waiting in their first collective), then,
    when the ranks build one job together, every rank's config, device, loss, optimizer and
    model (names, shapes, dtypes). Ranks that all ask for no parallelism train as
    independent processes (each its own model) once they have agreed on that."""
    comm.idle_barrier(
        "the agreement at Trainer construction (in a world of several ranks every rank "
        "builds its Trainer, with the same parallelism settings; a Trainer of one rank "
        "alone is built with Trainer(..., local=True))")
    parallelism = {"config": {k: plan.config[k] for k in PARALLELISM_FIELDS}}
    raise_if_ranks_differ(comm.mpi_comm.allgather(parallelism), "asked for different parallelism")
    if not plan.layout.spmd:  # every rank agreed to train on its own
        return
    description = {
        "config": plan.config, "device": device_lib.parse(device)[0], "loss": loss,
        "optimizer": [type(optimizer).__name__, optimizer.config()],
        "model": [[n, list(map(int, s)), str(d)] for n, (s, d) in
                  zip(model.param_names, model.param_specs())],
        "inputs": [[list(map(int, s)), str(d)] for s, d in model.input_specs],
        "embedding_plan": ({str(k): repr(v) for k, v in embedding_plan.items()}
                           if isinstance(embedding_plan, dict) else repr(embedding_plan))}
    raise_if_ranks_differ(comm.mpi_comm.allgather(description), "built different Trainers")


def step_description(executor: Any) -> Dict[str, Any]:
    """What an executor's compiled functions are built from, besides the model's parameters:
    inputs, target, loss, optimizer, device, config, sizes and versions."""
    signature = executor.signature
    return {
        "inputs": [[list(map(int, s)), str(d)] for s, d in signature.input_specs],
        "target": [list(map(int, signature.target_spec[0])), str(signature.target_spec[1])],
        "loss": executor.loss, "optimizer": type(executor.optimizer).__name__,
        "device": device_lib.parse(executor.device)[0],
        "optimizer_config": executor.optimizer.config(), "config": executor.config,
        "world_size": executor.parallel.grad_world,
        "tensor_parallel_size": executor.parallel.tp,
        "precision": executor.precision, "grad_reduce_dtype": executor.grad_reduce_dtype,
        "recompute": getattr(executor, "recompute", None),
        "versions": [__version__, tvm.__version__]}


def fingerprint(description: Dict[str, Any]) -> Tuple[str, Dict[str, Any]]:
    """(digest, description): what every rank of a job must agree on before the first
    collective; the compiled step is a function of it."""
    text = json.dumps(description, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16], description


def check_fingerprints(comm: Any, digest: str, description: Dict[str, Any]) -> None:
    """Every rank's compiled-step fingerprint against rank 0's (after ``agree``, this also
    covers what the built step derived: parameter shapes, inputs, versions)."""
    everyone = comm.mpi_comm.allgather((digest, description))
    if len({d for d, _ in everyone}) > 1:
        raise_if_ranks_differ([desc for _, desc in everyone], "built different training steps")


def raise_if_ranks_differ(descriptions: List[Dict[str, Any]], what: str) -> None:
    """ValueError naming the fields in which some rank's description differs from rank 0's."""
    def flat(description: Dict[str, Any]) -> Dict[str, Any]:  # "config.zero_opt_level"
        out = {}
        for key, value in description.items():
            if isinstance(value, dict):
                out.update({f"{key}.{k}": v for k, v in value.items()})
            else:
                out[key] = value
        return out

    mine = flat(descriptions[0])
    for rank, theirs in enumerate(map(flat, descriptions)):
        differing = [k for k in mine if theirs.get(k) != mine[k]]
        if differing:
            show = {k: (mine[k], theirs.get(k)) for k in differing}
            raise raised_on_every_rank(ValueError(
                f"the ranks {what}: rank {rank} differs from rank 0 in {', '.join(differing)} "
                f"(rank 0 vs rank {rank}: {json.dumps(show, default=str)[:600]}). Every rank "
                "must create the same model, loss, optimizer, device and "
                "dist.get_config() settings"))
