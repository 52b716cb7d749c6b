"""Chapter 10 exercises: tensor parallelism (Megatron-style sharding of a Llama model).

Fill in every function that raises NotImplementedError, then grade your work:

    kvlab grade ch10                                 # in a terminal
    kvlab.check("ch10")                              # in the notebook
    pytest tests/graded -m ch10 --impl=exercises     # the same tests, raw

Tasks: ``shard_shapes`` (the shape of every weight one rank holds), ``shard_weight`` (cut one
rank's part out of a full checkpoint tensor), ``collectives`` (which layers end in an
all-reduce, and where the all-gather goes). The engine's own versions live in
``kvlab/models/parallel.py``; your ``shard_shapes`` is then checked against the live engine
at ``tensor_parallel_size=2``. Stuck? ``kvlab.use_solution("ch10")`` swaps in the answer and
keeps yours as ``exercises/ch10_mine.py``.
"""
import torch  # noqa: F401  (you may use it)

WEIGHTS = ("embed_tokens", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")


# -- task shard_shapes ---------------------------------------------------------------------------
def shard_shapes(config, tensor_parallel_size: int) -> dict:
    """``{name: (rows, columns)}`` of the weights one rank holds, for each name in ``WEIGHTS``
    (a ``[out, in]`` matrix, as ``nn.Linear`` stores it; the tables are ``[vocab, hidden]``).

    ``config`` has ``hidden_size``, ``num_heads``, ``num_kv_heads``, ``head_dim``,
    ``intermediate_size`` and ``vocab_size`` (chapter 1's ``ModelSpec``, or a ``ModelConfig``).
    With ``N = tensor_parallel_size``:

    * column-parallel layers (q/k/v, gate/up) split their **output** features: each rank holds
      ``num_heads / N`` query heads, ``num_kv_heads / N`` KV heads, ``intermediate_size / N``
      MLP features;
    * row-parallel layers (o_proj, down_proj) split their **input** features the same way;
    * ``embed_tokens`` and ``lm_head`` split the vocabulary: ``ceil(vocab_size / N)`` rows each
      (the last rank's extra rows are padding).

    Raise a ValueError naming the count (``"num_heads"``, ``"num_kv_heads"`` or
    ``"intermediate_size"``) that N does not divide. Example: Llama-3-8B at N = 8 holds
    q_proj ``(512, 4096)``, k_proj ``(128, 4096)``: one KV head per rank.
    """
    raise NotImplementedError("shard_shapes: divide heads, KV heads and intermediate_size by N (out features of "
                              "q/k/v/gate/up, in features of o/down); ceil(vocab / N) rows of the tables")


# -- task shard_weight --------------------------------------------------------------------------
def shard_weight(name: str, weight: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s part (of ``size``) of the full checkpoint tensor ``name``, e.g.
    ``"model.layers.0.self_attn.q_proj.weight"`` (HF's names; the layer is the next-to-last part).

    * q/k/v_proj, gate_proj, up_proj (weights and biases): the rank's ``1/size`` of the rows,
      in order (rank 0 the first rows);
    * o_proj, down_proj weights: the rank's ``1/size`` of the columns; their biases: the whole
      bias on rank 0 and zeros on the others (the all-reduce after them adds it once);
    * embed_tokens, lm_head: rows ``rank * c .. (rank + 1) * c - 1`` with ``c = ceil(V / size)``,
      zero rows where they run past ``V``, so every rank's table has ``c`` rows;
    * anything else (the norms): the whole tensor.

    Return a new tensor (not a view of ``weight``).
    """
    raise NotImplementedError("shard_weight: rows (chunk dim 0) for column-parallel layers, columns (dim 1) "
                              "for row-parallel ones, padded vocabulary rows for the tables")


# -- task collectives ---------------------------------------------------------------------------
def collectives(num_layers: int) -> list:
    """The collectives of one forward at N > 1, in the order they run: ``(layer, op)`` with
    ``layer`` one of ``"embed_tokens"``, ``"layers.{i}.o_proj"``, ``"layers.{i}.down_proj"``,
    ``"lm_head"`` and ``op`` ``"all_reduce"`` or ``"all_gather"``.

    A layer whose ranks each hold a partial sum of the output ends in an all-reduce (the
    embedding: each rank looked up only its own rows); the LM head's ranks each hold the logits
    of their slice of the vocabulary, which an all-gather puts side by side. Column-parallel
    layers need nothing. Example: ``collectives(1)`` has 4 entries.
    """
    raise NotImplementedError("collectives: embed_tokens all-reduce, then o_proj and down_proj of every layer, "
                              "then the lm_head's all-gather")
