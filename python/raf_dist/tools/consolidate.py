"""Full fp32 parameters of a sharded checkpoint in one safetensors file.

    python -m raf_dist.tools.consolidate ckpt/ model.safetensors

Reads ``ckpt/latest`` (or a checkpoint directory), checks every rank file's size and sha256,
then assembles one parameter at a time from the ranks' slices and streams it into the
output, so memory stays at the largest parameter. Names are the model's parameter names
(for a PyTorch model, those of ``named_parameters()``), followed by the persistent buffers
(``named_buffers()`` minus the non-persistent ones, as in PyTorch's ``state_dict()``)::

    from safetensors.torch import load_file
    module.load_state_dict(load_file("model.safetensors"))

The output is written to a temporary name and renamed when complete. Nothing is unpickled.
"""
from __future__ import annotations

import argparse
import json
import os
import struct
import sys
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from .. import checkpoint as ckpt

_SAFETENSORS_DTYPES = {"float32": "F32", "float64": "F64", "float16": "F16", "int64": "I64",
                       "int32": "I32", "int8": "I8", "uint8": "U8", "bool": "BOOL"}


def consolidate(checkpoint: str | os.PathLike[str], output: str | os.PathLike[str],
                dtype: str = "float32") -> list[str]:
    """Write the full parameters of ``checkpoint`` to ``output`` (safetensors); returns the
    parameter names written."""
    directory = ckpt.resolve(checkpoint)
    meta = ckpt.read_meta(directory)
    ckpt.verify_files(directory, meta)
    out_dtype = np.dtype(dtype)
    # (name, checkpoint key, stored dtype, dtype written): parameters, then the persistent
    # buffers (PyTorch's state_dict has them; integer ones such as num_batches_tracked keep
    # their dtype)
    tensors = [dict(p, key=ckpt.param_key(p["name"]), out=out_dtype)
               for p in meta["model"] + meta.get("frozen", [])]
    # every further name of a tied parameter (module.state_dict() lists them all, so
    # load_state_dict(strict=True) needs them), with the parameter's values
    by_name = {p["name"]: p for p in tensors}
    tensors += [dict(by_name[name], name=alias)
                for alias, name in meta.get("tied_params", {}).items() if name in by_name]
    tensors += [dict(b, key=ckpt.buffer_key(b["name"]),
                     out=out_dtype if np.dtype(b["dtype"]).kind == "f" else np.dtype(b["dtype"]))
                for b in meta.get("buffers", []) if b["persistent"]]
    # the safetensors layout: u64 header length, JSON header (offsets), raw little-endian data
    header: dict[str, Any] = {}
    offset = 0
    for p in tensors:
        nbytes = int(np.prod(p["shape"], dtype=np.int64)) * p["out"].itemsize
        header[p["name"]] = {"dtype": _SAFETENSORS_DTYPES[p["out"].name], "shape": p["shape"],
                             "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = {"format": "pt", "source": str(directory),
                              "step": str(meta["step"])}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # align the data section
    output = Path(output)
    tmp = output.with_name(f".{output.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(text)))
            f.write(text)
            for p in tensors:
                numel = int(np.prod(p["shape"], dtype=np.int64))
                values = ckpt.read_range(directory, meta, p["key"], numel, 0, numel,
                                         np.dtype(p["dtype"]))
                f.write(values.astype(p["out"].newbyteorder("<"), copy=False).tobytes())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, output)
    finally:
        if tmp.exists():
            tmp.unlink()
    return [p["name"] for p in tensors]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m raf_dist.tools.consolidate",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="checkpoint root (with 'latest') or a step directory")
    parser.add_argument("output", help="the .safetensors file to write")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64", "float16"])
    args = parser.parse_args(argv)
    try:
        names = consolidate(args.checkpoint, args.output, args.dtype)
    except ckpt.CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {len(names)} tensors (parameters and persistent buffers) to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
