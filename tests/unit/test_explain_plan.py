"""raf_dist.explain_parallel_plan and ``python -m raf_dist.tools.explain_plan``: the
tensor-parallel plan as text, in one process (no MPI)."""
import json
import os
import re
import subprocess
import sys

import pytest
import torch

import raf_dist
from models import TransformerBlock
from mpi_launch import ROOT


@pytest.fixture(scope="module")
def block():
    torch.manual_seed(0)
    return raf_dist.frontend.from_pytorch(TransformerBlock(heads=4),
                                          (torch.zeros(2, 8, dtype=torch.long),))


def placement(text, name):
    line = next((ln for ln in text.splitlines() if ln.split()[:1] == [name]), None)
    assert line is not None, f"{name} missing from the plan:\n{text}"
    return line


def test_explain_names_the_megatron_pairs(block):
    text = raf_dist.explain_parallel_plan(block, 2)
    assert text.startswith("tensor parallel plan, T = 2"), text
    assert re.search(r"colwise\s+split dim 0 \(3 segments\)", placement(text, "qkv.weight")), text
    assert re.search(r"rowwise\s+split dim 1", placement(text, "proj.weight")), text
    assert re.search(r"colwise\s+split dim 0", placement(text, "fc1.weight")), text
    assert re.search(r"bias\s+split dim 0", placement(text, "fc1.bias")), text
    assert re.search(r"rowwise\s+split dim 1", placement(text, "fc2.weight")), text
    for name in ("ln1.weight", "ln2.bias", "proj.bias", "fc2.bias", "pos"):
        assert "replicated" in placement(text, name), text
    # cross-entropy: the head splits along the vocabulary (the loss reduces across tp)
    assert re.search(r"colwise\s+split dim 0", placement(text, "head.weight")), text
    assert "vocabulary-parallel cross-entropy" in text, text


def test_explain_mse_keeps_the_head_whole(block):
    text = raf_dist.explain_parallel_plan(block, 2, loss="mse")
    assert "replicated" in placement(text, "head.weight"), text
    # g after attention and after the MLP (and after the embedding when it splits by
    # vocabulary); f before the two column layers
    forward = int(re.search(r"forward: (\d+) allreduce\(s\) over tp", text).group(1))
    assert forward == 2 + ("vocab" in placement(text, "tok.weight")), text
    assert re.search(r"backward: 2 allreduce\(s\) over tp", text), text


def test_explain_is_the_plans_text_and_takes_an_explicit_plan(block):
    from raf_dist.training.tensor_parallel import make_plan

    assert raf_dist.explain_parallel_plan(block, 2) == make_plan(block, 2).explain()
    text = raf_dist.explain_parallel_plan(block, 2,
                                          plan={"fc1": "colwise", "fc2.weight": "rowwise"})
    assert re.search(r"colwise\s+split dim 0", placement(text, "fc1.weight")), text
    assert "replicated" in placement(text, "qkv.weight"), text
    with pytest.raises(ValueError, match="matches no parameter"):
        raf_dist.explain_parallel_plan(block, 2, plan={"nothing_like_this": "colwise"})
    with pytest.raises(TypeError, match="captured raf_dist Model"):
        raf_dist.explain_parallel_plan(TransformerBlock(), 2)


def test_explain_says_a_vocabulary_tp_does_not_divide_is_padded():
    """37 classes at T = 2: the table, the head and its bias hold 38 rows (19 per rank), the
    text names the padding and where it goes; with mse the head stays whole, the table alone
    is padded (no logits to mask)."""
    torch.manual_seed(0)
    model = raf_dist.frontend.from_pytorch(TransformerBlock(vocab=37, heads=4),
                                           (torch.zeros(2, 8, dtype=torch.long),))
    text = raf_dist.explain_parallel_plan(model, 2)
    for name in ("tok.weight", "head.weight", "head.bias"):
        assert "padded to 38 (1 zero row)" in placement(text, name), text
    assert "[37, 16]" in placement(text, "head.weight"), text
    assert "the vocabulary of 37 is padded to 38, a multiple of T = 2 (19 rows per rank" in text
    assert "masked out of the loss and predict" in text, text
    text = raf_dist.explain_parallel_plan(model, 2, loss="mse")
    assert "padded to 38" in placement(text, "tok.weight"), text
    assert "replicated" in placement(text, "head.weight"), text
    assert "masked" not in text, text


def run_cli(*args):
    # the tests' models are importable as `models` (a module spec)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT / "tests")] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    return subprocess.run([sys.executable, "-m", "raf_dist.tools.explain_plan", *map(str, args)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)


def test_cli_prints_the_plan_of_a_factory(tmp_path):
    factory = tmp_path / "block_factory.py"
    factory.write_text(
        "import sys, torch\n"
        f"sys.path.insert(0, {str(ROOT / 'tests')!r})\n"
        "from models import TransformerBlock\n"
        "def make():\n"
        "    torch.manual_seed(0)\n"
        "    return TransformerBlock(heads=4), torch.zeros(2, 8, dtype=torch.long)\n")
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"fc1": "colwise", "fc2.weight": "rowwise"}))
    out = run_cli("--tp", "2", f"{factory}:make")
    assert out.returncode == 0, out.stderr
    assert re.search(r"colwise\s+split dim 0 \(3 segments\)", placement(out.stdout, "qkv.weight"))
    out = run_cli("--tp", "2", "--plan", plan, f"{factory}:make")
    assert out.returncode == 0, out.stderr
    assert "replicated" in placement(out.stdout, "qkv.weight"), out.stdout
    assert re.search(r"rowwise\s+split dim 1", placement(out.stdout, "fc2.weight")), out.stdout


def test_cli_module_spec_and_errors():
    out = run_cli("--tp", "2", "models:transformer4")
    assert out.returncode == 0, out.stderr
    assert re.search(r"colwise\s+split dim 0 \(3 segments\)", placement(out.stdout, "qkv.weight"))
    assert re.search(r"bias\s+split dim 0", placement(out.stdout, "fc1.bias")), out.stdout
    out = run_cli("--tp", "2", "raf_dist.tools.explain_plan:no_such_factory")
    assert out.returncode == 2 and "no callable 'no_such_factory'" in out.stderr, out.stderr
