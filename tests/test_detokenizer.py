"""Incremental detokenization gives the full decode's text at every step."""
import random

import pytest
from tokenizers import Tokenizer

from kvlab.engine.detokenizer import TextState, detokenize
from kvlab.engine.llm import DEFAULT_MODEL


@pytest.mark.parametrize("text", ["def add(a, b):\n    return a + b\n", "héllo wörld → ✓ 你好 🙂 naïve",
                                  "    x  =  '  spaced  '\t\tend"])
def test_step_by_step_text_equals_the_full_decode(text):
    tok = Tokenizer.from_file(str(DEFAULT_MODEL / "tokenizer.json"))
    ids = tok.encode(text).ids
    state = TextState()
    for n in range(1, len(ids) + 1):
        shown = detokenize(tok, ids[:n], state)
        full = tok.decode(ids[:n], skip_special_tokens=True)
        assert full.startswith(shown) and (shown == full or full[len(shown):] == "\ufffd" or "\ufffd" in full)
    assert shown == tok.decode(ids, skip_special_tokens=True)


def test_random_tokens_in_random_steps():
    tok = Tokenizer.from_file(str(DEFAULT_MODEL / "tokenizer.json"))
    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(tok.get_vocab_size()) for _ in range(60)]
        state, n = TextState(), 0
        while n < len(ids):
            n = min(len(ids), n + rng.randint(1, 3))
            detokenize(tok, ids[:n], state)
        full = tok.decode(ids, skip_special_tokens=True)
        assert state.text == full or (full.endswith("\ufffd") and full.startswith(state.text))
