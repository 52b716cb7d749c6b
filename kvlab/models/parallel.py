"""Tensor parallelism (Megatron-style): one model split across N ranks, each with its own heads.

Every rank runs the same step on the same tokens, holding ``1/N`` of each large matrix. A
``[out, in]`` weight is split one of two ways (vLLM's names):

* **column-parallel**: by output features (the weight's rows). Each rank computes its own
  slice of the output; nothing to exchange. q/k/v (each rank its own query heads *and* the KV
  heads they read), gate and up.
* **row-parallel**: by input features (the weight's columns). It reads the column-parallel
  layer's slice, and each rank's product is a partial sum of the full output: one
  **all-reduce** adds them up. o_proj and down_proj.

==============  ====================  ========================================  ==========
layer           split                 rank ``r`` of ``N`` holds                 then
==============  ====================  ========================================  ==========
embed_tokens    by vocabulary         its ``ceil(V / N)`` rows of the table      all-reduce
q/k/v_proj      column-parallel       its ``H / N`` query and ``KV / N`` KV heads
attention       none                  its KV heads' K/V in its own paged cache
o_proj          row-parallel          the input columns of its query heads       all-reduce
gate/up_proj    column-parallel       its ``I / N`` intermediate features
down_proj       row-parallel          the input columns of those features        all-reduce
lm_head         by vocabulary         its ``ceil(V / N)`` rows                   all-gather
==============  ====================  ========================================  ==========

So a step costs ``2 * num_layers + 1`` all-reduces of ``[tokens, hidden]`` and one all-gather
of the logits (:func:`collectives_per_step`). A row-parallel layer's bias is kept on rank 0
only (zeros elsewhere), so the all-reduce adds it once. The vocabulary is padded up to a
multiple of N (the padding rows are zeros and their logits are cut off); the heads and the MLP
must divide evenly (:func:`check_tensor_parallel_size`).

Weights are cut from the full checkpoint by name as it loads (:func:`shard_weight`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

#: How each checkpoint weight is split, by the name of its layer (norms are whole on every rank).
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")
VOCAB_PARALLEL = ("embed_tokens", "lm_head")


@dataclass(frozen=True)
class ParallelContext:
    """Which rank of how many this copy of the model is; its collectives run over ``group``
    (a ``torch.distributed`` process group; None: the default one). At ``size`` 1 every
    collective returns its input untouched."""

    rank: int = 0
    size: int = 1
    group: object = None

    def __post_init__(self):
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank must be in 0..{self.size - 1}, got {self.rank}")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the ranks, in place, on every rank."""
        if self.size > 1:
            torch.distributed.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., n]`` of every rank side by side in rank order: ``[..., size * n]``."""
        if self.size == 1:
            return x
        parts = torch.empty((self.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        _all_gather_single(parts, x.contiguous(), group=self.group)
        return torch.cat(parts.chunk(self.size), dim=-1)

    def agree_min(self, n: int, device) -> int:
        """The smallest of every rank's ``n`` (each rank sizes its cache; all must agree)."""
        if self.size == 1:
            return n
        t = torch.tensor([n], dtype=torch.int64, device=device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def divide(self, n: int, what: str) -> int:
        """``n / size``, for a count the ranks split evenly."""
        if n % self.size:
            raise ValueError(f"tensor_parallel_size={self.size} must divide {what} ({n})")
        return n // self.size


SINGLE = ParallelContext()
# one tensor in, the ranks' tensors stacked along dim 0 out (the newer name first)
_all_gather_single = getattr(torch.distributed, "all_gather_single", None) or torch.distributed.all_gather_into_tensor


def vocab_shard_size(vocab_size: int, size: int) -> int:
    """Rows of the embedding table (and of the LM head) each rank holds: ``ceil(V / N)``."""
    return -(-vocab_size // size)


def check_tensor_parallel_size(size: int, config) -> None:
    """Refuse a ``tensor_parallel_size`` the model cannot be split by, naming the rule.

    kvlab splits the KV heads across ranks and never replicates them (vLLM copies each KV head
    to several ranks when there are more ranks than KV heads): so N must divide
    ``num_key_value_heads``, and ``num_attention_heads`` and ``intermediate_size`` too."""
    for field, hf_name in (("num_heads", "num_attention_heads"), ("num_kv_heads", "num_key_value_heads"),
                           ("intermediate_size", "intermediate_size")):
        n = getattr(config, field)
        if n % size:
            extra = " (kvlab splits KV heads across ranks; it does not replicate them)" \
                if field == "num_kv_heads" else ""
            raise ValueError(f"tensor_parallel_size={size} must divide the model's {hf_name} ({n}){extra}")


def collectives_per_step(num_layers: int) -> dict:
    """The collectives one forward makes at N > 1: an all-reduce after each row-parallel layer
    (two per layer) and after the embedding, an all-gather of the logits."""
    return {"all_reduce": 2 * num_layers + 1, "all_gather": 1}


# -- cutting the full weights ------------------------------------------------------------------
def column_shard(weight: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s rows (output features) of a ``[out, in]`` weight, or of a bias ``[out]``."""
    return weight.chunk(size, dim=0)[rank].clone()


def row_shard(weight: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s columns (input features) of a ``[out, in]`` weight."""
    return weight.chunk(size, dim=1)[rank].contiguous().clone()


def vocab_shard(weight: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s ``ceil(V / N)`` rows of a ``[V, hidden]`` table, zero rows past ``V``."""
    rows = vocab_shard_size(weight.shape[0], size)
    part = weight[rank * rows:(rank + 1) * rows]
    out = weight.new_zeros(rows, *weight.shape[1:])
    out[:part.shape[0]] = part
    return out


def shard_weight(name: str, tensor: torch.Tensor, tp: ParallelContext) -> torch.Tensor:
    """The part of the full checkpoint tensor ``name`` (HF's names) that ``tp``'s rank holds."""
    if tp.size == 1:
        return tensor
    layer, kind = name.split(".")[-2:]
    if layer in COLUMN_PARALLEL:
        return column_shard(tensor, tp.rank, tp.size)
    if layer in ROW_PARALLEL:
        if kind == "bias":              # added once: by rank 0, before the all-reduce
            return tensor.clone() if tp.rank == 0 else torch.zeros_like(tensor)
        return row_shard(tensor, tp.rank, tp.size)
    if layer in VOCAB_PARALLEL:
        return vocab_shard(tensor, tp.rank, tp.size)
    return tensor                       # norms: whole on every rank


# -- the two vocabulary-parallel layers -------------------------------------------------------
def vocab_parallel_embedding(ids: torch.Tensor, embedding: nn.Embedding, tp: ParallelContext) -> torch.Tensor:
    """Each rank looks up the ids in its rows (zeros for the others'); the all-reduce adds
    the ranks' rows up, so every token gets its one row."""
    if tp.size == 1:
        return embedding(ids)
    local = ids - tp.rank * embedding.num_embeddings
    elsewhere = (local < 0) | (local >= embedding.num_embeddings)
    x = embedding(local.masked_fill(elsewhere, 0)).masked_fill_(elsewhere.unsqueeze(-1), 0)
    return tp.all_reduce(x)


def gather_logits(local_logits: torch.Tensor, vocab_size: int, tp: ParallelContext) -> torch.Tensor:
    """The LM head's logits over the whole vocabulary from each rank's ``[..., ceil(V / N)]``."""
    if tp.size == 1:
        return local_logits
    return tp.all_gather(local_logits)[..., :vocab_size]
