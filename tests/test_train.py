"""The training script end to end, in its CPU smoke mode: train, save, load back, generate."""
import json
from pathlib import Path

import torch

import kvlab  # noqa: F401  (profile first)
from kvlab import train
from kvlab.models import load_model

WEIGHTS = Path(train.__file__).parent / "models" / "weights"


def test_smoke_training_saves_loadable_models(tmp_path, capsys):
    log = train.main(["--out", str(tmp_path), "--smoke", "--device", "cpu"])
    printed = capsys.readouterr().out
    assert "target step" in printed and "completions" in printed

    for name in ("target", "draft"):
        entry = log["models"][name]
        assert entry["steps_done"] == entry["recipe"]["steps"] and not entry["stopped_early"]
        assert entry["recipe"]["model"]["num_layers"] == train.SMOKE_RECIPES[name].model.num_layers
        losses = [p["loss"] for p in entry["curve"]]
        assert len(losses) == entry["steps_done"] and all(l == l and l < 10 for l in losses)  # finite
        model, tok, config = load_model(tmp_path / train.checkpoint_folder(name))
        assert config.tie_word_embeddings and config.eos_token_id == tok.token_to_id(train.EOT) == 0
        assert model.num_parameters() == entry["params"]
        prompt = tok.encode("def __init__(self").ids
        new = model.generate(prompt, max_new_tokens=5, eos_token_id=-1)
        assert len(new) == 5 and all(0 <= t < config.vocab_size for t in new)
        assert isinstance(tok.decode(new), str)
        assert set(entry["samples"]) == set(train.PROMPTS)
        # both checkpoints carry the one shared tokenizer
        assert (tmp_path / train.checkpoint_folder(name) / "tokenizer.json").read_text() == (tmp_path / "tokenizer.json").read_text()

    saved = json.loads((tmp_path / "train_log.json").read_text())
    assert saved["corpus"]["files"] == 40 and saved["tokenizer"]["vocab_size"] == train.SMOKE_VOCAB_SIZE
    assert 0 <= saved["draft_target_agreement"] <= 1
    assert "PSF" in (tmp_path / "README.md").read_text()


def test_the_recipes_fit_the_brief():
    """Target ~5-20M and draft ~1-2M parameters, together <= 40 MB in bf16."""
    sizes = {name: r.model_config(train.VOCAB_SIZE, 0).num_params for name, r in train.RECIPES.items()}
    assert 5e6 <= sizes["target"] <= 20e6 and 1e6 <= sizes["draft"] <= 2e6
    assert 2 * sum(sizes.values()) <= 40e6


def test_a_recipe_holds_the_shipped_models_config():
    """A recipe's shape is a ModelConfig: with the tokenizer's vocabulary it is the shipped config.json."""
    from kvlab.models import ModelConfig

    for name, recipe in train.RECIPES.items():
        folder = WEIGHTS / train.checkpoint_folder(name)
        shipped = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
        made = recipe.model_config(shipped.vocab_size, shipped.eos_token_id)
        assert made.to_dict() | {"extra": {}} == shipped.to_dict() | {"extra": {}}, name


def test_the_tokenizer_is_reproducible():
    texts = ["def f(x):\n    return x + 1\n", "import os\nprint(os.sep)\n"] * 3
    a = train.train_tokenizer(texts, 300)
    b = train.train_tokenizer(texts, 300)
    assert a.to_str() == b.to_str() and a.token_to_id(train.EOT) == 0


def test_lr_schedule_warms_up_then_decays():
    r = train.SMOKE_RECIPES["target"]
    r = train.Recipe(**{**r.__dict__, "steps": 100, "warmup": 10, "lr": 1.0})
    lrs = [train.lr_at(s, r) for s in range(100)]
    assert lrs[0] < lrs[9] == 1.0 and lrs[-1] >= r.min_lr_ratio and lrs[50] < lrs[10]
    assert torch.tensor(lrs[10:]).diff().le(1e-12).all()
