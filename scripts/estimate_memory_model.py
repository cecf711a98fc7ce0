"""Example model file for ``python -m raf_dist.tools.estimate_memory --script``: the digits
CNN of scripts/distributed/dist_example.py, captured with a per-rank batch of 16 (a global
batch of 32 on 2 ranks)."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "distributed"))


def get_model():
    import raf_dist
    from dist_example import DigitsCNN

    torch.manual_seed(0)
    return raf_dist.frontend.from_pytorch(DigitsCNN(), (torch.zeros(16, 1, 8, 8),))
