"""transformers checkpoints in and out (DESIGN.md section 1, "Training-loop essentials"):
a trained raf_dist checkpoint of a transformers model exports (raf_dist.tools.export_hf) to a
directory ``AutoModelForCausalLM.from_pretrained`` loads, whose logits equal raf_dist's
``predict``; and a directory transformers saved is the starting point of a Trainer."""
import numpy as np
import pytest
import torch

import raf_dist
from hf import LogitsOnly, hf_model, import_transformers, make_hf, raf_adamw
from models import rel_err

# float32 forwards of the same weights in two libraries: sums in another order, ~1e-7 each
TOL = 1e-5


@pytest.mark.parametrize("name", ["gpt2"])  # tied head; Llama comes in by the import test
def test_export_loads_in_transformers_with_the_trained_weights(name, tmp_path):
    transformers = import_transformers()
    module, x, y = make_hf(name, 4)
    trainer = raf_dist.Trainer(raf_dist.frontend.from_pytorch(module, (x,)), optimizer=raf_adamw())
    for _ in range(2):
        trainer.step(x.numpy(), y.numpy())
    config = module.model.config
    trainer.save_checkpoint(tmp_path / "ckpt", extra={"hf": {
        "class": type(module.model).__name__, "config": config.to_dict(), "prefix": "model."}})
    from raf_dist.tools import export_hf

    assert export_hf.main([str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 0
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    trained = trainer.state_dict()
    for key, value in loaded.named_parameters():  # the trained weights, tied ones included
        assert np.array_equal(value.detach().numpy(), trained["model." + key]), key
    if getattr(config, "tie_word_embeddings", False):
        assert loaded.lm_head.weight is loaded.get_input_embeddings().weight
    with torch.no_grad():
        theirs = loaded(x).logits.numpy()
    assert rel_err(trainer.predict(x.numpy()), theirs) <= TOL


def test_export_without_a_config_names_the_fix(tmp_path):
    module, x, y = make_hf("gpt2", 4)
    trainer = raf_dist.Trainer(raf_dist.frontend.from_pytorch(module, (x,)), optimizer=raf_adamw())
    trainer.save_checkpoint(tmp_path / "ckpt")
    from raf_dist.tools import export_hf

    with pytest.raises(ValueError, match="pass --config"):
        export_hf.export(tmp_path / "ckpt", tmp_path / "out")
    module.model.config.save_pretrained(tmp_path / "cfg")  # --config DIR works instead
    assert export_hf.main([str(tmp_path / "ckpt"), str(tmp_path / "out"),
                           "--config", str(tmp_path / "cfg")]) == 0


def test_a_saved_transformers_directory_starts_a_trainer(tmp_path):
    """save_pretrained -> from_pretrained -> from_pytorch: the Trainer starts from the saved
    weights (predict equals the loaded model's logits) and trains."""
    transformers = import_transformers()
    hf_model("llama", seed=3).model.save_pretrained(tmp_path / "saved")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "saved"))
    _, x, y = make_hf("llama", 4)
    module = LogitsOnly(loaded)
    trainer = raf_dist.Trainer(raf_dist.frontend.from_pytorch(module, (x,)), optimizer=raf_adamw())
    with torch.no_grad():
        theirs = loaded.eval()(x).logits.numpy()
    assert rel_err(trainer.predict(x.numpy()), theirs) <= TOL
    first = trainer.step(x.numpy(), y.numpy())
    assert trainer.step(x.numpy(), y.numpy()) < first
