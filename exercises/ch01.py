"""Chapter 1 exercises: KV memory accounting.

Fill in every function that raises NotImplementedError, then grade your work:

    kvlab grade ch01                                 # in a terminal
    kvlab.check("ch01")                              # in the notebook
    pytest tests/graded -m ch01 --impl=exercises     # the same tests, raw

Tasks: ``kv_bytes_per_token``, ``max_sequences``, ``paged_waste``. Plain integer arithmetic:
no kvlab imports needed. Stuck? ``kvlab.use_solution("ch01")`` swaps in the answer and keeps
yours as ``exercises/ch01_mine.py``.
"""


# -- task kv_bytes_per_token ----------------------------------------------------------------
def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Bytes of KV cache one token takes in the whole model.

    Every layer stores a key and a value vector for each KV head.
    Example: Llama-3-70B (80 layers, 8 KV heads, head_dim 128) in bf16 (2 bytes) -> 327680.
    """
    raise NotImplementedError(
        "kv_bytes_per_token: each layer stores one K and one V vector of head_dim elements "
        "per KV head; multiply by the bytes of one element")


# -- task max_sequences ---------------------------------------------------------------------
def max_sequences(gpu_bytes: int, weight_bytes: int, kv_bytes_per_token: int, seq_len: int,
                  gpu_memory_utilization: float = 0.9) -> int:
    """How many sequences of ``seq_len`` tokens fit in the KV cache of one GPU, the vLLM way.

    The KV budget is ``int(gpu_memory_utilization * gpu_bytes) - weight_bytes`` bytes;
    return how many whole sequences fit in it. If the budget is not positive (the weights do
    not fit), raise ``ValueError`` with a message that says so.
    Example: gpu_bytes=100, weight_bytes=40, kv_bytes_per_token=2, seq_len=10, utilization
    0.9 -> budget 50 bytes, one sequence needs 20 -> 2.
    """
    raise NotImplementedError(
        "max_sequences: one sequence needs seq_len * kv_bytes_per_token bytes; "
        "count whole ones with // and check the budget first")


# -- task paged_waste -----------------------------------------------------------------------
def paged_waste(seq_lens: list[int], block_size: int) -> int:
    """Empty token slots in the last blocks of sequences stored in blocks of ``block_size``.

    A sequence of ``n`` tokens holds ceil(n / block_size) blocks; only its last block can be
    partly empty. Sum the empty slots over all sequences (a sequence of 0 tokens holds no
    block and wastes nothing).
    Example: seq_lens=[1, 16, 17], block_size=16 -> 15 + 0 + 15 = 30.
    """
    raise NotImplementedError(
        "paged_waste: n tokens hold ceil(n / block_size) blocks (integer ceil: -(-n // block_size)); "
        "the waste is the slots those blocks have beyond n")
