"""Chapter 1 answers: the same names and signatures as ``exercises/ch01.py``."""


# -- task kv_bytes_per_token ----------------------------------------------------------------
def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Bytes of KV cache one token takes in the whole model."""
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


# -- task max_sequences ---------------------------------------------------------------------
def max_sequences(gpu_bytes: int, weight_bytes: int, kv_bytes_per_token: int, seq_len: int,
                  gpu_memory_utilization: float = 0.9) -> int:
    """How many sequences of ``seq_len`` tokens fit in the KV cache of one GPU, the vLLM way."""
    budget = int(gpu_memory_utilization * gpu_bytes) - weight_bytes
    if budget <= 0:
        raise ValueError(f"the weights ({weight_bytes} bytes) do not fit in "
                         f"{gpu_memory_utilization} x {gpu_bytes} bytes")
    return budget // (seq_len * kv_bytes_per_token)


# -- task paged_waste -----------------------------------------------------------------------
def paged_waste(seq_lens: list[int], block_size: int) -> int:
    """Empty token slots in the last blocks of sequences stored in blocks of ``block_size``."""
    waste = 0
    for n in seq_lens:
        blocks = (n + block_size - 1) // block_size
        waste += blocks * block_size - n
    return waste
