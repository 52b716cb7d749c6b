"""Layer 5: the serving engine, shaped like vLLM's offline API.

>>> from kvlab.engine import LLM, SamplingParams
>>> llm = LLM(enable_prefix_caching=True)                                        # doctest: +SKIP
>>> [out] = llm.generate("def fib(n):", SamplingParams(temperature=0, max_tokens=32))  # doctest: +SKIP
>>> out.outputs[0].text                                                           # doctest: +SKIP

One concept per module: :mod:`~kvlab.engine.sampling_params` (what a request asks for),
:mod:`~kvlab.engine.sequence` (one sample's tokens and state), :mod:`~kvlab.engine.scheduler`
(continuous batching, preemption, forking), :mod:`~kvlab.engine.sampler` (logits to tokens),
:mod:`~kvlab.engine.model_runner` (the model, the paged KV cache, one step),
:mod:`~kvlab.engine.cuda_graphs` (decode steps replayed as CUDA graphs),
:mod:`~kvlab.engine.spec_decode` (speculative decoding's proposers),
:mod:`~kvlab.engine.rejection_sampler` (keeping drafts exactly),
:mod:`~kvlab.engine.tensor_parallel` (one process per rank, rank 0 the engine),
:mod:`~kvlab.engine.config` (every setting, checked once), :mod:`~kvlab.engine.inputs` and
:mod:`~kvlab.engine.outputs` (what goes in and comes out) and :mod:`~kvlab.engine.llm` (the
front door).
"""
from kvlab.engine.config import EngineConfig
from kvlab.engine.llm import LLM, CompletionOutput, RequestOutput
from kvlab.engine.rejection_sampler import rejection_sample
from kvlab.engine.sampling_params import RequestOutputKind, SamplingParams
from kvlab.engine.scheduler import Scheduler, SchedulerOutput
from kvlab.engine.sequence import Sequence, SequenceStatus, SpecDecodeStats
from kvlab.engine.spec_decode import SpeculativeConfig

__all__ = ["LLM", "EngineConfig", "SamplingParams", "RequestOutputKind", "RequestOutput", "CompletionOutput",
           "Scheduler", "SchedulerOutput", "Sequence", "SequenceStatus", "SpecDecodeStats", "SpeculativeConfig",
           "rejection_sample"]
