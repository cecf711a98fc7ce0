"""torchvision for the tests: its models without its compiled operators, the tiny vision
models the numeric and distributed tiers train, and the measurement their tolerances come from
(``float32_spread``: how far PyTorch's own float32 runs land from its float64 run).

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
import contextlib
import sys

import numpy as np
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
    smooth_resnet: the same ResNet (same initial values) with GELU for every ReLU and 3 x 3
    average pooling (stride 2, padding 1: the same shapes) for the max pooling, so that the
    loss is a smooth function of the parameters. ReLU and max pooling make discrete decisions
    (a sign, a window's winner), and some of the ResNet's ~10^5 per step lie closer to their
    boundary than float32 rounding (measured, 12 rows: a smallest pre-activation of 3.0e-6
    against a float32 error of 2.1e-6 in that tensor). A run in another summation order can
    decide one of them the other way, and the gradient of that element jumps by its whole
    size: PyTorch's own float32 gradients land up to 2.1e-2 from its float64 ones
    (tests/numeric/test_vision_models.py), its weights after 6 SGD steps up to 2.7e-3 with
    lr=0.05 and 9.0e-5 with lr=0.01 (workers/vision_train.py), in a few of 34 summation orders
    and ~2e-6 in the others. Which orders jump depends on the machine; the smooth model's
    differences follow the rounding.
    vit: torchvision's VisionTransformer on 16 x 16 images in 8 x 8 patches (4 tokens and the
    class token), one encoder layer of width 16 with 2 heads, 5 classes."""
    models = import_torchvision_models()
    torch.manual_seed(seed)
    if name in ("resnet", "smooth_resnet"):
        module = models.resnet.ResNet(models.resnet.BasicBlock, [1, 1, 1, 1], num_classes=10)
        shape, classes = (batch, 3, 32, 32), 10
        if name == "smooth_resnet":  # ResNet and BasicBlock each call self.relu
            for block in [module] + [b for layer in (module.layer1, module.layer2, module.layer3,
                                                     module.layer4) for b in layer]:
                block.relu = torch.nn.GELU()
            module.maxpool = torch.nn.AvgPool2d(3, stride=2, padding=1)
    elif name == "vit":
        module = models.VisionTransformer(image_size=16, patch_size=8, num_layers=1, num_heads=2,
                                          hidden_dim=16, mlp_dim=32, num_classes=5)
        shape, classes = (batch, 3, 16, 16), 5
    else:
        raise ValueError(f"unknown vision model {name!r}; expected 'resnet', 'smooth_resnet' "
                         "or 'vit'")
    gen = torch.Generator().manual_seed(seed + 1)
    return (module, torch.randn(shape, generator=gen),
            torch.randint(0, classes, (batch,), generator=gen))


# Summation orders for float32_spread: PyTorch's default (oneDNN convolutions), its native
# kernels, channels_last tensors, 2 threads, and 30 runs whose data and initial values are
# perturbed by about one float32 rounding (relative 1e-7, seeded by the number), which stand
# in for other machines' orders.
SUMMATION_ORDERS = ("oneDNN", "native", "channels_last", "2 threads") + tuple(range(30))


@contextlib.contextmanager
def summation_order(order, module, tensors, dtype):
    """(module, tensors) in ``dtype`` and ``order`` (see SUMMATION_ORDERS), the order's PyTorch
    settings in force inside the block; integer tensors are left as they are."""
    floating = [t for t in tensors if t.is_floating_point()]
    if isinstance(order, int):
        gen = torch.Generator().manual_seed(order)
        with torch.no_grad():
            for t in floating + list(module.parameters()):
                t.mul_(1 + 1e-7 * torch.randn(t.shape, generator=gen))
    module = module.to(dtype)
    tensors = tuple(t.to(dtype) if t.is_floating_point() else t for t in tensors)
    if order == "channels_last":
        module = module.to(memory_format=torch.channels_last)
        tensors = tuple(t.to(memory_format=torch.channels_last) if t.dim() == 4 else t
                        for t in tensors)
    threads, onednn = torch.get_num_threads(), torch.backends.mkldnn.enabled
    torch.set_num_threads(2 if order == "2 threads" else threads)
    torch.backends.mkldnn.enabled = onednn and order != "native"
    try:
        yield module, tensors
    finally:
        torch.set_num_threads(threads)
        torch.backends.mkldnn.enabled = onednn


def float32_spread(label, run, orders=SUMMATION_ORDERS):
    """Print how far PyTorch's float32 runs land from its float64 run: the worst norm-relative
    distance of any value (and its order), the median over orders of each run's worst, and
    the worst of the first value (the losses). ``run(dtype, order)`` returns the compared
    values by name (numpy arrays or lists), the losses first, computed inside
    ``summation_order``. Returns the worst distance."""
    from models import rel_err  # tests/models.py; bench/models.py imports this file too

    exact = run(torch.float64, "oneDNN")
    first = next(iter(exact))
    worst, first_worst = [], 0.0
    for order in orders:
        got = run(torch.float32, order)
        errs = {name: rel_err(got[name], value) for name, value in exact.items()}
        name = max(errs, key=errs.get)
        worst.append((errs[name], name, order))
        first_worst = max(first_worst, errs[first])
    err, name, order = max(worst, key=lambda w: w[0])
    print(f"{label}: worst {err:.2e} ({name}, order {order!r}), median "
          f"{np.median([w[0] for w in worst]):.2e}, {first} {first_worst:.2e}, over "
          f"{len(orders)} summation orders")
    return err
