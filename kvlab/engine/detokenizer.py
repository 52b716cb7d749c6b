"""Incremental detokenization: each step turns only a sequence's newest tokens into text.

Decoding a sequence's whole output every step costs O(length) per step (at batch 32 and 256
tokens, ~1.7 ms of the host's time per step). Decoding only the new token is wrong for
byte-level BPE: a character can span tokens (the first token alone decodes to the replacement
character U+FFFD) and a decoder may drop or add spaces at a boundary. So, as vLLM does, decode
a short window that starts at the tokens already shown, and keep what the window adds.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TextState:
    """A sequence's text so far, and where its next window starts."""

    text: str = ""
    prefix_offset: int = 0   # the window's first token (already shown)
    read_offset: int = 0     # the first token not yet shown


def detokenize(tokenizer, token_ids: list[int], state: TextState) -> str:
    """Bring ``state.text`` up to ``token_ids`` (a sequence's output tokens); returns it."""
    if tokenizer is None or state.read_offset >= len(token_ids):
        return state.text
    shown = tokenizer.decode(token_ids[state.prefix_offset:state.read_offset], skip_special_tokens=True)
    window = tokenizer.decode(token_ids[state.prefix_offset:], skip_special_tokens=True)
    # An unfinished character decodes as U+FFFD: wait for the token that completes it.
    if len(window) > len(shown) and not window.endswith("\ufffd"):
        state.text += window[len(shown):]
        state.prefix_offset, state.read_offset = state.read_offset, len(token_ids)
    return state.text
