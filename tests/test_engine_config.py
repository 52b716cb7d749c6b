"""EngineConfig (every setting checked once), vLLM's import, and the CUDA-graph buckets."""
import pytest
import torch

import kvlab
from kvlab.engine import EngineConfig
from kvlab.engine.cuda_graphs import CudaGraphs
from kvlab.paging import allocate_kv_cache


def test_vllms_import_works():
    from kvlab import LLM, SamplingParams
    from kvlab.engine import LLM as EngineLLM

    assert LLM is EngineLLM and SamplingParams().max_tokens > 0
    with pytest.raises(AttributeError):
        kvlab.no_such_thing  # noqa: B018


@pytest.mark.parametrize("settings, error, match", [
    ({"block_size": 0}, ValueError, "block_size"),
    ({"block_size": 16.0}, TypeError, "block_size"),
    ({"max_num_seqs": True}, TypeError, "max_num_seqs"),
    ({"enable_prefix_caching": "no"}, TypeError, "enable_prefix_caching"),
    ({"enforce_eager": 1}, TypeError, "enforce_eager"),
    ({"gpu_memory_utilization": 1.5}, ValueError, "gpu_memory_utilization"),
    ({"gpu_memory_utilization": float("nan")}, ValueError, "gpu_memory_utilization"),
    ({"num_gpu_blocks": -3}, ValueError, "num_gpu_blocks"),
    ({"seed": "1"}, TypeError, "seed"),
])
def test_bad_settings_are_refused(settings, error, match):
    with pytest.raises(error, match=match):
        EngineConfig(**settings)


def test_settings_that_depend_on_the_model():
    c = EngineConfig(max_num_seqs=8).resolve(context_length=1024)
    assert c.max_model_len == 1024 and c.max_num_batched_tokens == 2048
    with pytest.raises(ValueError, match="max_model_len"):
        EngineConfig(max_model_len=4096).resolve(context_length=1024)


def test_llm_refuses_unknown_settings():
    from kvlab import LLM

    with pytest.raises(TypeError, match="unknown settings.*block_sise"):
        LLM(block_sise=16)


def test_graph_buckets():
    assert EngineConfig(max_num_seqs=32).cudagraph_batch_sizes() == [1, 2, 4, 8, 16, 24, 32]
    assert EngineConfig(max_num_seqs=9).cudagraph_batch_sizes() == [1, 2, 4, 8, 9]
    assert EngineConfig(max_num_seqs=1).cudagraph_batch_sizes() == [1]
    assert EngineConfig(max_num_seqs=2048).cudagraph_batch_sizes()[-1] == 512
    cache = allocate_kv_cache(1, 4, 4, 1, 16, dtype=torch.float32)
    graphs = CudaGraphs(model=None, kv_cache=cache, backend=None, batch_sizes=[1, 2, 4, 8, 16, 24, 32],
                        max_model_len=64)
    assert [graphs.bucket(b) for b in (1, 2, 3, 5, 9, 17, 24, 25, 32)] == [1, 2, 4, 8, 16, 24, 24, 32, 32]
    assert graphs.bucket(33) is None          # larger batches run eagerly


def test_only_graph_safe_backends_are_captured():
    from kvlab.models import get_attention_backend

    assert get_attention_backend("triton").cuda_graph_safe
    assert not get_attention_backend("reference").cuda_graph_safe
    assert not get_attention_backend("torch").cuda_graph_safe
    assert not get_attention_backend(lambda *a: None).cuda_graph_safe
