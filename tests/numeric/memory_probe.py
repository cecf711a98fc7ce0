"""One process: capture MODEL, build a Trainer, take 3 steps; print JSON with the RSS growth
since just before the capture and stats()'s total (tests/numeric/test_process_memory.py).

    python tests/numeric/memory_probe.py wide_mlp|gpt2|resnet [--estimate]

With ``--estimate`` the process captures MODEL and calls ``raf_dist.estimate_memory`` instead
(no Trainer, no step; MPI loaded, not started), and prints its figures and its RSS growth.
"""
import gc
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: models.py, hf.py, vision.py

import torch  # noqa: E402

import raf_dist  # noqa: E402
from raf_dist import process_memory  # noqa: E402


def make(name):
    """(module, input, target): models whose tensors, not only the libraries, are sizeable."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    if name == "wide_mlp":  # parameters and optimizer state dominate (9.5M parameters)
        from models import MLP

        return (MLP((256,) + (2048,) * 3 + (10,)), torch.randn(512, 256, generator=gen),
                torch.randint(0, 10, (512,), generator=gen))
    if name == "gpt2":  # transformers GPT-2: activations and logits dominate
        from hf import LogitsOnly, import_transformers

        transformers = import_transformers()
        config = transformers.GPT2Config(vocab_size=8192, n_positions=128, n_embd=256,
                                         n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
                                         attn_pdrop=0.0)
        ids = torch.randint(0, 8192, (16, 128), generator=gen)
        return (LogitsOnly(transformers.GPT2LMHeadModel(config)), ids,
                torch.randint(0, 8192, (16, 128), generator=gen))
    if name == "resnet":  # torchvision ResNet-10: convolutions and batch norm
        from vision import import_torchvision_models

        models = import_torchvision_models()
        module = models.resnet.ResNet(models.resnet.BasicBlock, [1, 1, 1, 1], num_classes=10)
        return (module, torch.randn(64, 3, 32, 32, generator=gen),
                torch.randint(0, 10, (64,), generator=gen))
    raise ValueError(name)


def main():
    module, x, y = make(sys.argv[1])
    gc.collect()
    before = process_memory.rss_bytes()  # the user's module and data exist already
    if "--estimate" in sys.argv:
        estimate = raf_dist.estimate_memory(raf_dist.frontend.from_pytorch(module, (x,)),
                                            raf_dist.optim.AdamW(lr=1e-3), 1, 0)
        print(json.dumps({**estimate, "growth": process_memory.rss_bytes() - before,
                          "libraries": process_memory.library_bytes()}))
        return
    trainer = raf_dist.Trainer(raf_dist.frontend.from_pytorch(module, (x,)),
                               optimizer=raf_dist.optim.AdamW(lr=1e-3))
    construction_peak = process_memory.peak_rss_bytes()  # capture + Trainer
    for _ in range(3):
        trainer.step(x.numpy(), y.numpy())
    gc.collect()
    stats = trainer.stats()
    compiler = {path for _, _, path, _ in process_memory._smaps()
                if Path(path).name in process_memory.COMPILER_LIBRARIES}
    print(json.dumps({"growth": process_memory.rss_bytes() - before,
                      "construction_peak": construction_peak,
                      "steady_rss": process_memory.rss_bytes(),
                      "compiler_files": sorted(compiler),
                      "compiler_resident": process_memory._resident_file_bytes(compiler),
                      **{k: v for k, v in stats.items() if k.endswith("_bytes")
                         and isinstance(v, int)},
                      "libraries": process_memory.library_bytes()}))


if __name__ == "__main__":
    main()
