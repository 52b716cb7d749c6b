"""The sampler: from a batch of logits to one token per row.

Each row carries its own settings, applied in vLLM's order::

    logits --/temperature--> --top-k mask--> --top-p mask--> softmax --draw--> token

* ``temperature == 0`` (below :data:`GREEDY_TEMPERATURE`, where dividing by it would
  overflow) is greedy: the argmax of the raw logits, no randomness at all;
* ``top_k``: only the k largest logits stay (``k <= 0`` keeps all; ties at the k-th value
  all stay);
* ``top_p`` (nucleus): only the most likely tokens whose probabilities, summed from the
  top, first reach ``p`` stay; the most likely token always stays;
* the draw uses the row's own ``torch.Generator`` when one is given, so a seeded request
  draws the same tokens whatever else shares its batch.

The log-probability reported for each chosen token is taken from the *raw* logits (the
model's own distribution, before temperature and masks), as vLLM reports it by default.
Everything here is a function of its arguments: no state, no model.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

GREEDY_TEMPERATURE = 1e-5  # temperatures below this are treated as 0 (greedy)


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor   # [batch] int64
    logprobs: torch.Tensor    # [batch] float32: log p(token) under the raw logits

    def tolist(self) -> tuple[list[int], list[float]]:
        """The tokens and their log-probabilities on the host: one copy from the device."""
        both = torch.stack((self.token_ids.double(), self.logprobs.double())).tolist()
        return [int(t) for t in both[0]], both[1]


def _per_row(value, batch: int, dtype, device) -> torch.Tensor:
    t = torch.as_tensor(value, dtype=dtype, device=device)
    return t.expand(batch) if t.dim() == 0 else t


def apply_top_k(logits: torch.Tensor, top_k) -> torch.Tensor:
    """Set every logit below a row's k-th largest to -inf (``k <= 0`` or ``k >= vocab``: no mask)."""
    batch, vocab = logits.shape
    k = _per_row(top_k, batch, torch.int64, logits.device)
    k = torch.where((k <= 0) | (k > vocab), torch.full_like(k, vocab), k)
    kth_largest = logits.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
    return logits.masked_fill(logits < kth_largest, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p) -> torch.Tensor:
    """Keep, per row, the most likely tokens up to and including the one at which their
    summed probability first reaches ``top_p``; set the others to -inf."""
    batch = logits.shape[0]
    p = _per_row(top_p, batch, torch.float32, logits.device)
    probs = logits.float().softmax(dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs     # of the strictly likelier tokens
    drop_sorted = (mass_before >= p[:, None]) & (p[:, None] < 1)
    drop_sorted &= sorted_probs < sorted_probs[:, :1]               # tokens tied with the top all stay
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def sampling_probs(logits: torch.Tensor, temperature, top_k=0, top_p=1.0) -> torch.Tensor:
    """The distribution each row is drawn from: ``[batch, vocab]`` float32, rows sum to 1.

    Greedy rows (temperature 0) are one-hot at their argmax.
    """
    logits = logits.float()
    batch = logits.shape[0]
    t = _per_row(temperature, batch, torch.float32, logits.device)
    greedy = t < GREEDY_TEMPERATURE
    scaled = logits / torch.where(greedy, torch.ones_like(t), t)[:, None]
    probs = apply_top_p(apply_top_k(scaled, top_k), top_p).softmax(dim=-1)
    one_hot = torch.zeros_like(probs).scatter(1, logits.argmax(dim=-1, keepdim=True), 1.0)
    return torch.where(greedy[:, None], one_hot, probs)


def sample(logits: torch.Tensor, temperature, top_k=0, top_p=1.0, generators=None) -> SamplerOutput:
    """One token per row of ``logits [batch, vocab]``.

    ``temperature``, ``top_k``, ``top_p``: a number for every row or one per row.
    ``generators``: None (torch's global RNG) or one ``torch.Generator`` (or None) per row.
    Which rows are greedy is decided from ``temperature`` on the host (the engine passes a list),
    so an all-greedy batch is an argmax and nothing is read back from the device.
    """
    logits = logits.float()
    batch = logits.shape[0]
    temps = temperature.tolist() if isinstance(temperature, torch.Tensor) else temperature
    temps = [float(temps)] * batch if isinstance(temps, (int, float)) else [float(x) for x in temps]
    token_ids = logits.argmax(dim=-1)
    rows = [i for i, t in enumerate(temps) if t >= GREEDY_TEMPERATURE]
    if rows:
        probs = sampling_probs(logits[rows], [temps[i] for i in rows], _pick(top_k, rows), _pick(top_p, rows))
        token_ids[rows] = _draw(probs, [generators[i] for i in rows] if generators is not None else None)
    logprobs = logits.log_softmax(dim=-1).gather(1, token_ids[:, None]).squeeze(1)
    return SamplerOutput(token_ids=token_ids, logprobs=logprobs)


def _pick(value, rows: list[int]):
    t = torch.as_tensor(value)
    return t if t.dim() == 0 else t[rows]


def _draw(probs: torch.Tensor, generators) -> torch.Tensor:
    """One draw per row of ``probs``; rows with a generator use it, the rest share one call."""
    if generators is None or all(g is None for g in generators):
        return torch.multinomial(probs, 1).squeeze(1)
    return torch.cat([torch.multinomial(row, 1, generator=g) for row, g in zip(probs, generators)])
