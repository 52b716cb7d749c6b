"""What ``LLM.generate`` and ``LLM.step`` return, with vLLM's names and fields."""
from __future__ import annotations

from dataclasses import dataclass

from kvlab.engine.sequence import SpecDecodeStats


@dataclass
class CompletionOutput:
    """One sample of a request: its text and tokens, and why it ended."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    finish_reason: str | None = None      # "stop", "length", "error"; None while running
    stop_reason: int | str | None = None  # the stop string or stop token id, if one ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's prompt and its ``n`` samples; ``error`` says why it could not be served."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    outputs: list[CompletionOutput]
    finished: bool
    error: str | None = None
    num_cached_tokens: int = 0            # prompt tokens found in the prefix cache
    spec_decode_stats: SpecDecodeStats | None = None   # drafts proposed and kept, with speculation


