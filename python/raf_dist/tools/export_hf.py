"""A raf_dist checkpoint of a transformers model as a directory transformers loads.

    python -m raf_dist.tools.export_hf ckpt/ out/ [--config CONFIG] [--prefix model.]
    transformers.AutoModelForCausalLM.from_pretrained("out/")

Writes ``out/model.safetensors`` (the full float32 parameters, consolidated from any layout
by ``raf_dist.tools.consolidate``, under the names the transformers model has: the prefix of
the wrapper the model was captured through is removed) and ``out/config.json``. Tied
parameters are written once, under the name ``named_parameters()`` gives them (GPT-2's
``transformer.wte.weight``; transformers ties ``lm_head.weight`` to it on load). The config
comes from ``--config`` (a ``config.json`` or a directory holding one: the one the model was
built from) or from the checkpoint's ``extra["hf"] = {"class": ..., "config": ...,
"prefix": ...}`` (scripts/train_lm.py saves it so). transformers is not imported here.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

from .. import checkpoint as ckpt
from .consolidate import consolidate


def export(checkpoint: str | os.PathLike[str], output: str | os.PathLike[str],
           config: Optional[Dict[str, Any]] = None, prefix: Optional[str] = None) -> Path:
    """Write ``output``/model.safetensors and config.json from ``checkpoint``; returns the
    directory. ``config``: the transformers config as a dict (default: the checkpoint's
    ``extra["hf"]["config"]``); ``prefix``: removed from every name (default: the
    checkpoint's ``extra["hf"]["prefix"]``, else a prefix every name shares, as a wrapper's
    ``model.``)."""
    from safetensors.numpy import load_file, save_file

    meta = ckpt.read_meta(ckpt.resolve(checkpoint))
    recorded = (meta.get("extra") or {}).get("hf") if isinstance(meta.get("extra"), dict) else None
    recorded = recorded or {}
    config = dict(config if config is not None else recorded.get("config") or {})
    if not config:
        raise ValueError(f"{checkpoint}: no transformers config: the checkpoint's extra has no "
                         "'hf' entry; pass --config with the model's config.json (or the "
                         "directory it was loaded from)")
    if recorded.get("class") and not config.get("architectures"):
        config["architectures"] = [recorded["class"]]
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        merged = Path(tmp) / "merged.safetensors"
        consolidate(checkpoint, merged)
        tensors = load_file(str(merged))
    prefix = prefix if prefix is not None else recorded.get("prefix", _shared_prefix(tensors))
    if prefix and not all(name.startswith(prefix) for name in tensors):
        raise ValueError(f"not every parameter name starts with {prefix!r}: "
                         f"{sorted(n for n in tensors if not n.startswith(prefix))[:5]}")
    renamed = {name[len(prefix or ""):]: value for name, value in tensors.items()}
    save_file(renamed, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    return out


def _shared_prefix(tensors: Dict[str, Any]) -> str:
    """``model.`` when every name starts with it (a wrapper module's attribute), else ""."""
    heads = {name.split(".", 1)[0] for name in tensors}
    return f"{heads.pop()}." if len(heads) == 1 and all("." in n for n in tensors) else ""


def _read_config(path: str) -> Dict[str, Any]:
    p = Path(path)
    return dict(json.loads((p / "config.json" if p.is_dir() else p).read_text()))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m raf_dist.tools.export_hf",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a checkpoint directory or its parent (latest)")
    parser.add_argument("output", help="the directory to write (created)")
    parser.add_argument("--config", default=None,
                        help="config.json, or a directory holding it (default: the checkpoint's)")
    parser.add_argument("--prefix", default=None,
                        help="removed from every parameter name (default: the checkpoint's, or "
                             "a prefix all names share)")
    args = parser.parse_args(argv)
    try:
        out = export(args.checkpoint, args.output,
                     _read_config(args.config) if args.config else None, args.prefix)
    except (ValueError, ckpt.CheckpointError, OSError) as exc:
        print(f"export_hf: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out / 'model.safetensors'} and {out / 'config.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
