"""Tensor parallelism: the shard functions in one process, then the engine at N = 2 over gloo.

At tensor_parallel_size=2 greedy output must equal size 1's token for token (float32): on the
shipped tiny model (tied embeddings), on a tiny HF checkpoint (biases everywhere, an odd
vocabulary, so padded shards), with prefix caching, preemption and chunked prefill. A worker
that dies must stop the engine with a clear error, fast, and closing must reap every worker.
"""
import gc
import os
import signal
import time
from pathlib import Path

import pytest
import torch

import kvlab  # noqa: F401  (profile first)
from kvlab import LLM, SamplingParams
from kvlab.engine import EngineConfig
from kvlab.errors import EngineDeadError
from kvlab.models import LlamaForCausalLM, ModelConfig
from kvlab.models.attention import Attention
from kvlab.models.llama import MLP
from kvlab.models.parallel import (ParallelContext, check_tensor_parallel_size, collectives_per_step, column_shard,
                                   gather_logits, row_shard, shard_weight, vocab_parallel_embedding, vocab_shard)
from kvlab.models.rope import RotaryEmbedding

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = ["def add(a, b):", "import os\n", "class Stack:\n    def __init__(self):", "for i in range(10):"]
LONG = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"


def config(**kw) -> ModelConfig:
    shape = dict(architecture="LlamaForCausalLM", vocab_size=301, hidden_size=64, intermediate_size=96,
                 num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, attention_bias=True,
                 attention_out_bias=True, mlp_bias=True, max_position_embeddings=128)
    return ModelConfig(**{**shape, **kw})


class Unreduced(ParallelContext):
    """A rank whose all-reduce does nothing: its layer returns its own partial sum."""

    def all_reduce(self, x):
        return x


def shards_of(full: torch.nn.Module, make, size: int) -> list[torch.nn.Module]:
    """``make(tp)`` for each rank, loaded with that rank's cut of ``full``'s weights."""
    out = []
    for rank in range(size):
        part = make(Unreduced(rank, size))
        part.load_state_dict({n: shard_weight(n, t, part.tp) for n, t in full.state_dict().items()})
        out.append(part)
    return out


def tokens(outputs) -> list[list[int]]:
    assert all(o.error is None for o in outputs), [o.error for o in outputs]
    return [o.outputs[0].token_ids for o in outputs]


# -- the shard functions (no processes) ---------------------------------------------------------
def test_shard_shapes_of_every_weight():
    model = LlamaForCausalLM(config())
    tp = ParallelContext(1, 2)
    want = {"q_proj.weight": [32, 64], "k_proj.weight": [16, 64], "v_proj.bias": [16], "o_proj.weight": [64, 32],
            "o_proj.bias": [64], "gate_proj.weight": [48, 64], "down_proj.weight": [64, 48],
            "input_layernorm.weight": [64], "embed_tokens.weight": [151, 64], "lm_head.weight": [151, 64]}
    sharded = LlamaForCausalLM(config(), tp).state_dict()
    for name, tensor in model.state_dict().items():
        part = shard_weight(name, tensor, tp)
        assert part.shape == sharded[name].shape, name
        suffix = ".".join(name.split(".")[-2:])
        if suffix in want:
            assert list(part.shape) == want[suffix], name
    assert torch.equal(shard_weight("model.layers.0.self_attn.o_proj.bias", torch.ones(4), tp), torch.zeros(4))


def test_column_and_row_shards_reproduce_the_full_product():
    x, w = torch.randn(5, 12), torch.randn(8, 12)
    full = x @ w.T
    cols = [x @ column_shard(w, r, 4).T for r in range(4)]           # each rank: its output features
    assert torch.allclose(torch.cat(cols, dim=-1), full, atol=1e-5)
    rows = [x.chunk(4, dim=-1)[r] @ row_shard(w, r, 4).T for r in range(4)]   # partial sums
    assert torch.allclose(sum(rows), full, atol=1e-5)


def test_vocabulary_shards_pad_and_reproduce_the_lookup_and_the_logits():
    table = torch.randn(301, 8)                        # 301 = 151 + 150: rank 1 holds one zero row
    shards = [vocab_shard(table, r, 2) for r in range(2)]
    assert [s.shape[0] for s in shards] == [151, 151] and torch.equal(shards[1][-1], torch.zeros(8))
    ids = torch.tensor([0, 150, 151, 300, 7])
    rows = [vocab_parallel_embedding(ids, torch.nn.Embedding.from_pretrained(s), Unreduced(r, 2))
            for r, s in enumerate(shards)]
    assert torch.equal(sum(rows), table[ids])
    h = torch.randn(3, 8)
    local = torch.cat([h @ s.T for s in shards], dim=-1)       # what the all-gather puts side by side
    assert torch.allclose(local[:, :301], h @ table.T, atol=1e-5)
    logits = h @ table.T
    assert gather_logits(logits, 301, ParallelContext()) is logits         # one rank: nothing to gather


@pytest.mark.parametrize("size", [2, 4])
def test_attention_and_mlp_shards_sum_to_the_full_layer(size):
    torch.manual_seed(0)
    c = config(num_heads=8, num_kv_heads=4)
    rotary = RotaryEmbedding(c)
    full_attn, full_mlp = Attention(c, 0, rotary), MLP(c)
    for layer in (full_attn, full_mlp):
        for p in layer.parameters():
            torch.nn.init.normal_(p, std=0.2)
    x, positions = torch.randn(6, 64), torch.arange(6)
    with torch.no_grad():
        attn = shards_of(full_attn, lambda tp: Attention(c, 0, rotary, tp), size)
        assert attn[0].num_heads == 8 // size and attn[0].num_kv_heads == 4 // size
        assert torch.allclose(sum(a(x, positions) for a in attn), full_attn(x, positions), atol=1e-5)
        mlp = shards_of(full_mlp, lambda tp: MLP(c, tp), size)
        assert torch.allclose(sum(m(x) for m in mlp), full_mlp(x), atol=1e-5)


def test_collectives_per_step():
    assert collectives_per_step(32) == {"all_reduce": 65, "all_gather": 1}


# -- refusals ------------------------------------------------------------------------------------
@pytest.mark.parametrize("size, error, match", [
    (0, ValueError, "tensor_parallel_size must be >= 1"),
    (2.0, TypeError, "tensor_parallel_size must be an int"),
    (True, TypeError, "tensor_parallel_size must be an int"),
])
def test_bad_sizes_are_refused(size, error, match):
    with pytest.raises(error, match=match):
        EngineConfig(tensor_parallel_size=size)


def test_sizes_the_model_cannot_split_are_refused_before_any_process_starts():
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 must divide the model's num_attention_heads \(8\)"):
        LLM(tensor_parallel_size=3)
    with pytest.raises(ValueError, match=r"num_key_value_heads \(2\).*does not replicate"):
        LLM(tensor_parallel_size=4)
    with pytest.raises(ValueError, match=r"intermediate_size \(96\)"):
        check_tensor_parallel_size(64, config(num_heads=64, num_kv_heads=64, intermediate_size=96))
    with pytest.raises(ValueError, match="speculative_config is not supported with tensor_parallel_size > 1"):
        LLM(tensor_parallel_size=2, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(TypeError, match="needs a checkpoint folder"):
        LLM(LlamaForCausalLM(config()), tensor_parallel_size=2)
    assert not torch.distributed.is_initialized()


# -- the engine at N = 2 over gloo ------------------------------------------------------------------
def test_shipped_model_at_two_ranks_matches_one_and_hits_the_prefix_cache():
    settings = dict(block_size=8, enable_prefix_caching=True, max_model_len=256)
    one = LLM(**settings)
    alone = tokens(one.generate([*PROMPTS, LONG], GREEDY, use_tqdm=False) +
                   one.generate([LONG + "    pass"], GREEDY, use_tqdm=False))
    llm = LLM(tensor_parallel_size=2, **settings)
    try:
        runner = llm.model_runner
        assert runner.kv_cache.num_kv_heads == 1 and runner.model.model.layers[0].self_attn.num_heads == 4
        first = llm.generate([*PROMPTS, LONG], GREEDY, use_tqdm=False)
        again = llm.generate([LONG + "    pass"], GREEDY, use_tqdm=False)
        assert again[0].num_cached_tokens >= 40, "the repeated prompt did not hit the prefix cache"
        assert tokens(first + again) == alone
    finally:
        llm.close()
    assert all(p.exitcode == 0 for p in runner.workers.procs)
    assert not torch.distributed.is_initialized()


def run_step_by_step(llm) -> tuple[list[list[int]], int, int]:
    """Tokens of every prompt, preemptions, and steps that ran part of a prompt."""
    ids = [llm.add_request(p, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)) for p in
           [LONG, *PROMPTS]]
    done, preempted, chunks = {}, 0, 0
    while llm.has_unfinished_requests():
        done.update({o.request_id: o.outputs[0].token_ids for o in llm.step() if o.finished})
        preempted += len(llm.last_schedule.preempted)
        chunks += sum(not s.samples for s in llm.last_schedule.scheduled)
    return [done[i] for i in ids], preempted, chunks


def test_preemption_and_chunked_prefill_at_two_ranks():
    settings = dict(block_size=8, num_gpu_blocks=12, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=256,
                    enable_prefix_caching=True)
    alone, preempted, chunks = run_step_by_step(LLM(**settings))
    assert preempted and chunks, "the settings should force preemption and chunked prefill"
    llm = LLM(tensor_parallel_size=2, **settings)
    try:
        assert llm.pool.num_blocks == 12
        assert run_step_by_step(llm) == (alone, preempted, chunks)
    finally:
        llm.close()


def test_swapping_at_two_ranks():
    """Preemption by swapping (chapter 9): every rank moves its own KV heads of the blocks out
    and back; the tokens are those of one rank, with or without swapping."""
    settings = dict(block_size=8, num_gpu_blocks=12, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=256)
    plain, _, _ = run_step_by_step(LLM(**settings))
    llm = LLM(tensor_parallel_size=2, swap_space=0.01, preemption_mode="swap", **settings)
    try:
        tokens, preempted, _ = run_step_by_step(llm)
        assert preempted and llm.scheduler.num_swapped_out == llm.scheduler.num_preemptions
        assert tokens == plain
    finally:
        llm.close()


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    """A tiny Llama saved by transformers: biases on q/k/v/o and the MLP, 301 tokens, untied head."""
    transformers = pytest.importorskip("transformers")
    from helpers import tiny_tokenizer

    hf_config = transformers.LlamaConfig(vocab_size=301, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                         attention_bias=True, mlp_bias=True, tie_word_embeddings=False,
                                         initializer_range=0.2, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(hf_config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(std=0.2)
    path = tmp_path_factory.mktemp("tiny-hf")
    model.save_pretrained(path)
    tiny_tokenizer().save(str(path / "tokenizer.json"))
    return path


HF_PROMPTS = [[5, 17, 42, 99, 7], [300, 1, 2], list(range(100, 140))]


def test_hf_checkpoint_at_two_ranks_matches_one_and_closes_when_collected(hf_checkpoint):
    alone = tokens(LLM(hf_checkpoint, block_size=8).generate(prompt_token_ids=HF_PROMPTS, sampling_params=GREEDY,
                                                            use_tqdm=False))
    llm = LLM(hf_checkpoint, block_size=8, tensor_parallel_size=2)
    assert tokens(llm.generate(prompt_token_ids=HF_PROMPTS, sampling_params=GREEDY, use_tqdm=False)) == alone
    procs = llm.model_runner.workers.procs
    del llm
    gc.collect()
    assert [p.exitcode for p in procs] == [0] and not torch.distributed.is_initialized()


def test_a_dead_worker_stops_the_engine_with_a_clear_error(hf_checkpoint):
    llm = LLM(hf_checkpoint, block_size=8, tensor_parallel_size=2)
    try:
        assert tokens(llm.generate(prompt_token_ids=HF_PROMPTS[:1], sampling_params=GREEDY, use_tqdm=False))
        worker = llm.model_runner.workers.procs[0]
        os.kill(worker.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match=r"worker rank 1 \(pid \d+\) died"):
            llm.generate(prompt_token_ids=HF_PROMPTS, sampling_params=GREEDY, use_tqdm=False)
        with pytest.raises(EngineDeadError, match="rank 1"):          # and every later step too
            llm.generate(prompt_token_ids=HF_PROMPTS[:1], sampling_params=GREEDY, use_tqdm=False)
        assert time.monotonic() - start < 10
    finally:
        llm.close()
    assert worker.exitcode == -signal.SIGKILL and not torch.distributed.is_initialized()


def test_a_script_without_a_main_guard_is_told_why_its_workers_died(tmp_path):
    """Workers are spawned: each imports the script first, so a script that builds the engine
    at its top level builds it again in every worker, which dies. The error says what to do."""
    import subprocess
    import sys

    script = tmp_path / "serve.py"
    script.write_text("from kvlab import LLM\nLLM(tensor_parallel_size=2, device=\"cpu\")\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(kvlab.__file__).parents[1]),
                                                         os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode != 0
    assert 'before it started. From a script, build the engine under `if __name__ == "__main__":`' in run.stderr
