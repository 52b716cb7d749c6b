"""Chapter 10 answers: the same names and signatures as ``exercises/ch10.py``."""
import torch

WEIGHTS = ("embed_tokens", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")


# -- task shard_shapes ---------------------------------------------------------------------------
def shard_shapes(config, tensor_parallel_size: int) -> dict:
    n = tensor_parallel_size

    def split(count: str) -> int:
        value = getattr(config, count)
        if value % n:
            raise ValueError(f"tensor_parallel_size={n} must divide {count} ({value})")
        return value // n

    h, d = config.hidden_size, config.head_dim
    q, kv, i = split("num_heads") * d, split("num_kv_heads") * d, split("intermediate_size")
    vocab = -(-config.vocab_size // n)
    return {"embed_tokens": (vocab, h), "q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i), "lm_head": (vocab, h)}


# -- task shard_weight --------------------------------------------------------------------------
def shard_weight(name: str, weight: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    layer, kind = name.split(".")[-2:]
    if layer in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
        return weight.chunk(size, dim=0)[rank].clone()
    if layer in ("o_proj", "down_proj"):
        if kind == "bias":
            return weight.clone() if rank == 0 else torch.zeros_like(weight)
        return weight.chunk(size, dim=1)[rank].contiguous().clone()
    if layer in ("embed_tokens", "lm_head"):
        rows = -(-weight.shape[0] // size)
        part = weight[rank * rows:(rank + 1) * rows]
        out = weight.new_zeros(rows, *weight.shape[1:])
        out[:part.shape[0]] = part
        return out
    return weight.clone()


# -- task collectives ---------------------------------------------------------------------------
def collectives(num_layers: int) -> list:
    out = [("embed_tokens", "all_reduce")]
    for i in range(num_layers):
        out += [(f"layers.{i}.o_proj", "all_reduce"), (f"layers.{i}.down_proj", "all_reduce")]
    return out + [("lm_head", "all_gather")]
