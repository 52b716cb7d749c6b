"""Graded tests of chapter 10: ``pytest tests/graded -m ch10 --impl=exercises``."""
import pytest
import torch

from kvlab.accounting import get_spec
from kvlab.models import LlamaForCausalLM, ModelConfig
from kvlab.models import parallel
from kvlab.models.attention import Attention
from kvlab.models.llama import MLP
from kvlab.models.parallel import ParallelContext
from kvlab.models.rope import RotaryEmbedding

pytestmark = pytest.mark.ch10


def small_config(**kw) -> ModelConfig:
    shape = dict(architecture="LlamaForCausalLM", vocab_size=301, hidden_size=64, intermediate_size=96,
                 num_layers=2, num_heads=8, num_kv_heads=4, head_dim=8, attention_bias=True,
                 attention_out_bias=True, mlp_bias=True, max_position_embeddings=64)
    return ModelConfig(**{**shape, **kw})


class Unreduced(ParallelContext):
    """A rank whose all-reduce does nothing: its layer returns its own partial sum."""

    def all_reduce(self, x):
        return x


# -- shard_shapes ------------------------------------------------------------------------------
@pytest.mark.task("shard_shapes")
def test_llama3_8b_shard_shapes(ch10):
    spec = get_spec("llama-3-8b")
    got = ch10.shard_shapes(spec, 8)
    assert got["q_proj"] == (512, 4096) and got["k_proj"] == (128, 4096), \
        f"at N = 8 a rank holds 4 query heads and 1 KV head of 128: got q {got['q_proj']}, k {got['k_proj']}"
    assert got["o_proj"] == (4096, 512), f"o_proj splits its input features: got {got['o_proj']}"
    assert got["gate_proj"] == (1792, 4096) and got["down_proj"] == (4096, 1792), \
        f"the MLP's 14336 features split 8 ways: got gate {got['gate_proj']}, down {got['down_proj']}"
    assert got["embed_tokens"] == got["lm_head"] == (16032, 4096), \
        f"128256 vocabulary rows split 8 ways: got {got['embed_tokens']}"
    assert ch10.shard_shapes(spec, 1)["q_proj"] == (4096, 4096), "N = 1: the whole matrix"


@pytest.mark.task("shard_shapes")
@pytest.mark.parametrize("size", [1, 2, 4])
def test_shard_shapes_match_the_engines_model(ch10, size):
    config = small_config()
    model = LlamaForCausalLM(config, ParallelContext(0, size))
    want = {name.split(".")[-2]: tuple(p.shape) for name, p in model.named_parameters() if name.endswith("weight")}
    got = ch10.shard_shapes(config, size)
    for name in ch10.WEIGHTS:
        assert tuple(got[name]) == want[name], f"N = {size}, {name}: expected {want[name]}, got {got[name]}"


@pytest.mark.task("shard_shapes")
def test_sizes_that_do_not_divide_are_refused(ch10):
    # N = 3 divides neither 8 query heads nor 4 KV heads: naming either is right
    for size, count in ((3, "num_heads|num_kv_heads"), (8, "num_kv_heads")):
        with pytest.raises(ValueError, match=count):
            ch10.shard_shapes(small_config(), size)
    with pytest.raises(ValueError, match="intermediate_size"):
        ch10.shard_shapes(small_config(intermediate_size=98), 4)
    assert ch10.shard_shapes(small_config(vocab_size=301), 4)["lm_head"] == (76, 64), \
        "an uneven vocabulary is padded: ceil(301 / 4) = 76 rows"


# -- shard_weight ------------------------------------------------------------------------------
@pytest.mark.task("shard_weight")
@pytest.mark.parametrize("size", [2, 4])
def test_shard_weight_cuts_every_weight_as_the_engine_does(ch10, size):
    torch.manual_seed(0)
    model = LlamaForCausalLM(small_config(tie_word_embeddings=False))
    for rank in range(size):
        tp = ParallelContext(rank, size)
        for name, tensor in model.state_dict().items():
            got, want = ch10.shard_weight(name, tensor, rank, size), parallel.shard_weight(name, tensor, tp)
            assert tuple(got.shape) == tuple(want.shape), \
                f"{name}, rank {rank} of {size}: expected shape {tuple(want.shape)}, got {tuple(got.shape)}"
            assert torch.equal(got, want), f"{name}, rank {rank} of {size}: the right shape, the wrong numbers"
            assert got.data_ptr() != tensor.data_ptr() or tensor.numel() == 0, f"{name}: return a new tensor"


@pytest.mark.task("shard_weight")
@pytest.mark.parametrize("size", [2, 4])
def test_the_ranks_partial_sums_add_up_to_the_full_layers(ch10, size):
    torch.manual_seed(1)
    config = small_config()
    rotary = RotaryEmbedding(config)
    full_attn, full_mlp = Attention(config, 0, rotary), MLP(config)
    for layer in (full_attn, full_mlp):
        for p in layer.parameters():
            torch.nn.init.normal_(p, std=0.2)
    x, positions = torch.randn(5, 64), torch.arange(5)
    layers = ((full_attn, lambda tp: Attention(config, 0, rotary, tp), lambda f: f(x, positions)),
              (full_mlp, lambda tp: MLP(config, tp), lambda f: f(x)))
    with torch.no_grad():
        for full, make, call in layers:
            total = 0
            for rank in range(size):
                part = make(Unreduced(rank, size))
                part.load_state_dict({n: ch10.shard_weight(n, t, rank, size) for n, t in full.state_dict().items()})
                total = total + call(part)
            want = call(full)
            assert torch.allclose(total, want, atol=1e-4), \
                f"{type(full).__name__} at N = {size}: the all-reduce of your shards' outputs is off by " \
                f"{(total - want).abs().max():.3g} (a bias added on every rank?)"


# -- collectives -------------------------------------------------------------------------------
@pytest.mark.task("collectives")
def test_collectives_of_a_two_layer_model(ch10):
    assert [tuple(c) for c in ch10.collectives(2)] == [
        ("embed_tokens", "all_reduce"), ("layers.0.o_proj", "all_reduce"), ("layers.0.down_proj", "all_reduce"),
        ("layers.1.o_proj", "all_reduce"), ("layers.1.down_proj", "all_reduce"), ("lm_head", "all_gather")]


@pytest.mark.task("collectives")
@pytest.mark.parametrize("layers", [1, 32, 80])
def test_collectives_count_what_the_engine_does(ch10, layers):
    got = [op for _, op in ch10.collectives(layers)]
    want = parallel.collectives_per_step(layers)
    assert got.count("all_reduce") == want["all_reduce"] and got.count("all_gather") == want["all_gather"], \
        f"{layers} layers: expected {want}, got {got.count('all_reduce')} all-reduces and " \
        f"{got.count('all_gather')} all-gathers"


@pytest.mark.task("shard_shapes")
@pytest.mark.parametrize("size", [1, 2])
def test_shard_shapes_when_the_heads_are_wider_than_hidden(ch10, size):
    # num_heads * head_dim = 8 * 16 = 128 and num_kv_heads * head_dim = 64, with hidden_size 64
    # (Gemma-7B, Qwen3 are like this): the attention's width is not the hidden size.
    config = small_config(head_dim=16)
    model = LlamaForCausalLM(config, ParallelContext(0, size))
    want = {name.split(".")[-2]: tuple(p.shape) for name, p in model.named_parameters() if name.endswith("weight")}
    got = ch10.shard_shapes(config, size)
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        assert tuple(got[name]) == want[name], (
            f"N = {size}, hidden_size 64, 8 query heads and 4 KV heads of head_dim 16, {name}: expected "
            f"{want[name]}, got {got[name]} (the attention's width comes from the heads and head_dim, not hidden_size)")
