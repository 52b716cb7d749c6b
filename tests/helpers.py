"""Small helpers shared by several test files (imported as ``from helpers import ...``)."""
from __future__ import annotations


def tiny_tokenizer():
    """A byte-level BPE tokenizer trained in a blink on a few lines of code (no downloads)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=290, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["def f(self):\n    return self.x\n", "import os\nfor i in range(10):\n"] * 4,
                            trainer=trainer)
    return tok


def attempt_unchanged(pool, snapshot, call, expected_exc=None, match=None):
    """Run ``call``; if it raises, check it was expected and left ``snapshot(pool)`` unchanged.

    Returns ``(exception, None)`` or ``(None, result)``.
    """
    before = snapshot(pool)
    try:
        result = call()
    except Exception as exc:  # noqa: BLE001 - any failure must leave the pool unchanged
        assert snapshot(pool) == before, f"{type(exc).__name__} changed the pool"
        assert expected_exc is not None, f"unexpected {type(exc).__name__}: {exc}"
        assert isinstance(exc, expected_exc), (exc, expected_exc)
        if match is not None:
            assert match in str(exc), (match, str(exc))
        return exc, None
    assert expected_exc is None, f"expected {expected_exc.__name__}, got result {result!r}"
    return None, result
