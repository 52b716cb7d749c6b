"""Sequence: one sample of one request, as the scheduler sees it.

A request with ``n`` samples becomes ``n`` sequences. Each has its own id, which is also its
id in the :class:`~kvlab.paging.BlockPool`, and its own tokens: the prompt, then whatever it
has generated. Its life::

    WAITING --admitted--> RUNNING --stop / length / error--> FINISHED
       ^                     |
       +----preempted--------+   (blocks freed; prompt + output recomputed when readmitted)

``num_computed_tokens`` counts the tokens whose K/V are in the cache. A running sequence has
one token more than that: the token it sampled last, whose K/V the next step computes (and
whose logits give the token after it). A step therefore computes tokens
``num_computed_tokens .. num_tokens - 1``: the whole prompt after admission (less what the
prefix cache already holds), one token per decode step, prompt + output after a preemption.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from kvlab.engine.detokenizer import TextState
from kvlab.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"       # preempted, its K/V in host memory until it resumes (chapter 9)
    FINISHED = "finished"


@dataclass
class SpecDecodeStats:
    """Speculative decoding of one sequence (or, summed, of a request or the engine).

    ``num_drafts``: verification steps that checked at least one draft; ``num_draft_tokens``:
    drafts proposed (padding not counted); ``num_accepted_tokens``: drafts kept;
    ``accepted_per_position[i]``: steps whose draft ``i + 1`` was kept.
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, spec_token_ids: list[int], num_accepted: int) -> None:
        proposed = sum(t >= 0 for t in spec_token_ids)
        if not proposed:
            return
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += num_accepted
        grow = len(spec_token_ids) - len(self.accepted_per_position)
        self.accepted_per_position += [0] * max(0, grow)
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    def add(self, other: "SpecDecodeStats") -> "SpecDecodeStats":
        width = max(len(self.accepted_per_position), len(other.accepted_per_position))
        pad = lambda x: x + [0] * (width - len(x))  # noqa: E731
        return SpecDecodeStats(self.num_drafts + other.num_drafts, self.num_draft_tokens + other.num_draft_tokens,
                               self.num_accepted_tokens + other.num_accepted_tokens,
                               [a + b for a, b in zip(pad(self.accepted_per_position),
                                                      pad(other.accepted_per_position))])

    @property
    def acceptance_rate(self) -> float:
        """Drafts kept per draft proposed."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verification step: accepted drafts plus the one the target adds."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0


class Sequence:
    """Tokens and state of one sample: what the scheduler schedules and the pool stores."""

    def __init__(self, seq_id: int, request_id: str, prompt_token_ids, params: SamplingParams | None = None,
                 index: int = 0, generator: torch.Generator | None = None):
        self.seq_id = seq_id
        self.request_id = request_id
        self.index = index                       # which of the request's n samples
        self.params = params if params is not None else SamplingParams()
        self.token_ids: list[int] = [int(t) for t in prompt_token_ids]
        self.num_prompt_tokens = len(self.token_ids)
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens: int | None = None  # prefix-cache hit at the first admission
        self.num_preemptions = 0
        self.host_blocks: list[int] = []         # swapped out: its blocks' copies in host memory
        self.cumulative_logprob = 0.0
        self.generator = generator               # the sample's own RNG (None: torch's global one)
        self.forks: list[Sequence] = []          # samples that fork from this one after its prefill
        self.finish_reason: str | None = None    # "stop", "length" or "error"
        self.stop_reason: int | str | None = None  # the stop token id or stop string that ended it
        self.error: str | None = None
        self.text_state = TextState()             # its output as text, decoded step by step
        self.cache_salt: str | bytes | None = None  # its tenant (see BlockPool.allocate)
        self.spec_stats = SpecDecodeStats()       # its speculative decoding, if any
        self.arrival_time: float | None = None    # when the scheduler first queued it (its clock)

    # -- tokens ---------------------------------------------------------------------------
    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def num_new_tokens(self) -> int:
        """Tokens the next step must compute: all those not yet in the cache."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int, logprob: float = 0.0) -> None:
        self.token_ids.append(int(token_id))
        self.cumulative_logprob += float(logprob)

    def drop_last_tokens(self, logprobs: list[float]) -> None:
        """Take back the newest ``len(logprobs)`` output tokens, whose log-probabilities those are."""
        if not 0 < len(logprobs) <= self.num_output_tokens:
            raise ValueError(f"can drop 1..{self.num_output_tokens} output tokens, got {len(logprobs)}")
        del self.token_ids[-len(logprobs):]
        self.cumulative_logprob -= sum(float(v) for v in logprobs)

    # -- state changes --------------------------------------------------------------------
    def check_stop(self, eos_token_ids=(), max_model_len: int | None = None) -> bool:
        """After a new token: finish (and say so) if a token rule ends the sequence.

        EOS (unless ``ignore_eos``) and ``stop_token_ids`` give "stop"; ``max_tokens`` or
        the model's context length give "length". Stop *strings* need the text, so the
        engine, which holds the tokenizer, checks them.
        """
        token, p = self.last_token_id, self.params
        if not p.ignore_eos and token in eos_token_ids:
            self.finish("stop")
        elif p.stop_token_ids and token in p.stop_token_ids:
            self.finish("stop", stop_reason=token)
        elif self.num_output_tokens >= p.max_tokens:
            self.finish("length")
        elif max_model_len is not None and self.num_tokens >= max_model_len:
            self.finish("length")
        return self.is_finished

    def finish(self, reason: str, stop_reason=None, error: str | None = None) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.error = error

    def reset_for_recompute(self) -> None:
        """Preempted: nothing of it is cached any more; its tokens so far will be recomputed."""
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.num_preemptions += 1

    def swap_out(self, host_blocks: list[int]) -> None:
        """Preempted by swapping: its computed K/V waits in ``host_blocks`` (host memory)."""
        self.status = SequenceStatus.SWAPPED
        self.host_blocks = host_blocks
        self.num_preemptions += 1

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, request={self.request_id!r}, {self.status.value}, "
                f"prompt={self.num_prompt_tokens}, output={self.num_output_tokens}, "
                f"computed={self.num_computed_tokens})")
