"""torchvision for the tests: its models without its compiled operators, and the tiny vision
models the numeric and distributed tiers train.

Why a helper: the torchvision 0.28.0 wheel on the package index is a CUDA build. Next to the
CPU PyTorch (2.13.0+cpu) its ``_C.so`` does not load (``torchvision.extension`` catches the
OSError and reports ``_has_ops() == False``), and torchvision's own code is ready for that
(every operator registration is guarded by ``_has_ops()``) except two lines of
``torchvision/_meta_registrations.py``: ``torch.library.register_fake("torchvision::nms")``
and ``("torchvision::qnms")`` run unguarded and fail with ``RuntimeError: operator
torchvision::nms does not exist``, so ``import torchvision`` fails although the model code is
pure Python (measured 2026-11-24). ``import_torchvision_models`` then declares exactly those
two operator schemas (as torchvision's C++ library declares them; no kernel behind them) and
imports again: the fake registrations attach to the declarations, and ``torchvision.ops.nms``
still raises torchvision's own "Couldn't load custom C++ ops" before reaching the operator.
Nothing is declared when the import works as it is (a CPU build of torchvision whose ``_C``
loads would declare the same names itself and must not meet ours).
"""
import sys

import torch

# the schemas torchvision's csrc/ops/nms.cpp and quantized/cpu/qnms_kernel.cpp declare
_MISSING_SCHEMAS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}
_declared = []  # the torch.library.Library holding the declarations: alive as long as we are


def _forget_torchvision():
    """Drop the half-imported torchvision so that the next import starts from the top."""
    for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
        del sys.modules[name]


def import_torchvision_models():
    """``torchvision.models``, importable without torchvision's compiled operators."""
    try:
        import torchvision.models
        return torchvision.models
    except RuntimeError as err:
        if "torchvision::" not in str(err) or _declared:
            raise
    _forget_torchvision()
    library = torch.library.Library("torchvision", "FRAGMENT")
    for schema in _MISSING_SCHEMAS.values():
        library.define(schema)
    _declared.append(library)
    import torchvision.models
    return torchvision.models


def make_vision(name, batch, seed=0):
    """(module, images, labels) with random initial values (``seed``) and data.

    resnet: torchvision's ResNet with one BasicBlock per stage (widths 64-512 are fixed by
    BasicBlock), 10 classes, on 3 x 32 x 32 images: the last stage sees 1 x 1 pixels, so its
    batch norms average over the batch rows alone. Use 8 rows or more: with 2 rows each
    normalised value is +-1 whatever the input (the gradient into those layers is float
    noise), and with 4 the batch norm backward is still ill-conditioned enough that two
    float32 gradients in another summation order (raf_dist's and PyTorch's) differ by 2.5e-4,
    norm-relative (measured; 6.6e-6 with 8 rows).
    vit: torchvision's VisionTransformer on 16 x 16 images in 8 x 8 patches (4 tokens and the
    class token), one encoder layer of width 16 with 2 heads, 5 classes."""
    models = import_torchvision_models()
    torch.manual_seed(seed)
    if name == "resnet":
        module = models.resnet.ResNet(models.resnet.BasicBlock, [1, 1, 1, 1], num_classes=10)
        shape, classes = (batch, 3, 32, 32), 10
    elif name == "vit":
        module = models.VisionTransformer(image_size=16, patch_size=8, num_layers=1, num_heads=2,
                                          hidden_dim=16, mlp_dim=32, num_classes=5)
        shape, classes = (batch, 3, 16, 16), 5
    else:
        raise ValueError(f"unknown vision model {name!r}; expected 'resnet' or 'vit'")
    gen = torch.Generator().manual_seed(seed + 1)
    return (module, torch.randn(shape, generator=gen),
            torch.randint(0, classes, (batch,), generator=gen))
