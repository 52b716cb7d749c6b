"""The tiny models the course ships: present, small, HF-format, one tokenizer, and they speak Python."""
from pathlib import Path

import torch

import kvlab  # noqa: F401  (profile first)
from kvlab.engine.llm import DEFAULT_MODEL
from kvlab.models import load_model

WEIGHTS = DEFAULT_MODEL.parent
DRAFT = WEIGHTS / "kvlab-tiny-draft"


def test_both_checkpoints_fit_the_budget_and_share_a_tokenizer():
    sizes = {p.name: p.stat().st_size for p in WEIGHTS.rglob("*") if p.is_file()}
    assert sum(sizes.values()) <= 40e6, f"shipped weights take {sum(sizes.values()) / 1e6:.1f} MB"
    tokenizers = {(d / "tokenizer.json").read_text() for d in (DEFAULT_MODEL, DRAFT)}
    assert len(tokenizers) == 1


def test_the_target_and_the_draft_load_and_complete_python():
    target, tok, config = load_model(DEFAULT_MODEL, dtype=torch.float32)
    draft, _, draft_config = load_model(DRAFT, dtype=torch.float32)
    assert 5e6 <= target.num_parameters() <= 20e6 and 1e6 <= draft.num_parameters() <= 2e6
    assert config.vocab_size == draft_config.vocab_size
    prompt = tok.encode("def __init__(self").ids
    text = tok.decode(target.generate(prompt, max_new_tokens=8, eos_token_id=-1))
    assert "self" in text or ":" in text, f"the target completed `def __init__(self` with {text!r}"


def test_the_training_log_is_shipped_with_them():
    assert (WEIGHTS / "train_log.json").is_file() and (WEIGHTS / "LICENSE-PYTHON.txt").is_file()
    assert Path(WEIGHTS / "README.md").read_text().startswith("# kvlab tiny models")
