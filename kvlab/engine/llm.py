"""LLM: the engine's front door, shaped like vLLM's offline API.

>>> from kvlab import LLM, SamplingParams
>>> llm = LLM()                                   # the course's tiny model   # doctest: +SKIP
>>> outs = llm.generate(["def add(a, b):", "import"], SamplingParams(temperature=0, max_tokens=20))  # doctest: +SKIP
>>> outs[0].outputs[0].text                                                                         # doctest: +SKIP

Under the hood, one :meth:`LLM.step` is one round of continuous batching::

    scheduler.schedule()          which sequences run, how many tokens each (blocks booked in the pool)
    model_runner.compute_logits() copy-on-write copies, one packed forward over the paged cache
                                  (a CUDA graph replay for decode steps on a GPU)
    sampler                       one token per sequence, on the device; one copy to the host
    scheduler.update()            append the tokens, fork parallel samples, retire finished sequences

With ``speculative_config``, a proposer guesses k tokens for every decoding sequence right
after scheduling (their slots booked with ``scheduler.add_draft_tokens``), the forward scores
all k + 1 positions, and rejection sampling replaces the sampler for those sequences
(:mod:`kvlab.engine.spec_decode`); ``scheduler.update()`` cuts the rejected drafts' slots off.
    stop strings              checked on the detokenised text (the tokenizer lives here)

:meth:`LLM.generate` queues every prompt and steps until they are all done. A request the
engine cannot serve (an empty prompt, a bad parameter, a prompt longer than the context or the
whole cache) comes back as a :class:`RequestOutput` with ``error`` set and no outputs, while
the rest of the batch runs.
"""
from __future__ import annotations

import copy
import itertools
import random
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch

from kvlab import profile
from kvlab.engine.config import EngineConfig
from kvlab.engine.detokenizer import TextState, detokenize
from kvlab.engine.inputs import PROMPT_KEYS, as_token_id, params_per_prompt, prompt_item, prompt_items
from kvlab.engine.model_runner import ModelRunner, block_bytes
from kvlab.engine.offload import HostBlockAllocator, HostPrefixCache, default_costs
from kvlab.engine.outputs import CompletionOutput, RequestOutput
from kvlab.engine.rejection_sampler import rejection_sample
from kvlab.engine.sampler import sample
from kvlab.engine.sampling_params import RequestOutputKind, SamplingParams
from kvlab.engine.scheduler import Scheduler
from kvlab.engine.sequence import Sequence, SpecDecodeStats
from kvlab.engine.spec_decode import (DEFAULT_DRAFT_MODEL, DraftModelProposer, NgramProposer, propose_drafts,
                                      record_verification, verify_drafts)
from kvlab.engine.tensor_parallel import TensorParallelRunner, TensorParallelWorkers
from kvlab.errors import EngineDeadError
from kvlab.paging.block_pool import BlockPool, blocks_needed
from kvlab.paging.prefix_hash import check_salt

DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "models" / "weights" / "kvlab-tiny-target"


@dataclass
class Request:
    """The engine's record of one request: its prompt, parameters and samples."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    params: SamplingParams
    seqs: list[Sequence] = field(default_factory=list)
    error: str | None = None
    cache_salt: str | bytes | None = None     # the tenant: prefixes are shared only within one salt
    exception: Exception | None = None        # why it could not be served (add_request raises it)

    @property
    def finished(self) -> bool:
        return self.error is not None or all(s.is_finished for s in self.seqs)


# -- the engine ------------------------------------------------------------------------------
class LLM:
    """A small paged-KV serving engine with vLLM's offline interface.

    ``model``: a checkpoint folder (HF format: config.json, safetensors, tokenizer.json), or
    an already built :class:`~kvlab.models.LlamaForCausalLM` (then pass its ``tokenizer``);
    default: the course's tiny model. Every other keyword is a setting of
    :class:`~kvlab.engine.config.EngineConfig` (vLLM's names: ``block_size``,
    ``num_gpu_blocks``, ``gpu_memory_utilization``, ``max_num_seqs``,
    ``max_num_batched_tokens``, ``max_model_len``, ``enable_prefix_caching``,
    ``enforce_eager``, ``dtype``, ``device``, ``seed``, ``attention_backend``,
    ``speculative_config``, ``tensor_parallel_size``).

    With ``tensor_parallel_size=N`` the model is split across N processes (this one is rank 0;
    :mod:`kvlab.engine.tensor_parallel`); ``model`` must then be a checkpoint folder, and
    :meth:`close` stops the workers (so does garbage collection, or the interpreter's exit).

    On a GPU the engine captures CUDA graphs of decode steps at start-up (a progress bar
    shows it); ``enforce_eager=True`` runs every step eagerly instead.

    Plug-in points for your own pieces: ``attention_backend`` (a registered name or a function
    with the backend's signature, :mod:`kvlab.models.backends`); ``llm.pool`` (replace it,
    before any request, with a :class:`~kvlab.paging.BlockPool`-compatible pool of
    ``llm.model_runner.num_blocks`` blocks: ``llm.use_pool(pool)``); ``llm.sampler`` (a function
    with :func:`kvlab.engine.sampler.sample`'s signature); ``llm.rejection_sampler`` (a function
    with :func:`kvlab.engine.rejection_sampler.rejection_sample`'s signature); ``llm.proposer``
    (an object with :class:`~kvlab.engine.spec_decode.NgramProposer`'s methods).
    """

    def __init__(self, model=None, tokenizer=None, **settings):
        unknown = set(settings) - {f for f in EngineConfig.__dataclass_fields__}
        if unknown:
            raise TypeError(f"LLM got unknown settings {sorted(unknown)}; known: "
                            f"{', '.join(EngineConfig.__dataclass_fields__)}")
        config = EngineConfig(**settings)
        device = config.device or profile.DEVICE
        self._workers = None               # tensor parallelism: ranks 1 .. N-1, in processes of their own
        if config.tensor_parallel_size > 1:
            self._workers = TensorParallelWorkers(model, config.tensor_parallel_size, config.dtype, device)
            self.model, self.tokenizer = self._workers.load_rank0(tokenizer)
        else:
            self.model, self.tokenizer = _load(model, tokenizer, config.dtype, device)
        self.config = self.model.config
        self.engine_config = config.resolve(self.config.max_position_embeddings)
        self.max_model_len = config.max_model_len
        spec = config.speculative_config
        draft = self._load_draft(spec, config, device) if spec and spec.method == "draft_model" else None
        runner = ModelRunner if self._workers is None else partial(TensorParallelRunner, self._workers)
        self.model_runner = runner(
            self.model, block_size=config.block_size, num_gpu_blocks=config.num_gpu_blocks,
            gpu_memory_utilization=config.gpu_memory_utilization, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens, max_model_len=config.max_model_len,
            attention_backend=config.attention_backend, enforce_eager=config.enforce_eager,
            cudagraph_batch_sizes=config.cudagraph_batch_sizes(), kv_cache_dtype=config.kv_cache_dtype,
            swap_space=config.swap_space,
            extra_block_bytes=block_bytes(draft.config, config.block_size, draft.dtype) if draft else 0)
        self.proposer = self._make_proposer(spec, draft, config)
        self.spec_decode_stats = SpecDecodeStats() if spec else None
        self.sampler = sample
        self.rejection_sampler = rejection_sample
        self.use_pool(BlockPool(self.model_runner.num_blocks, config.block_size, config.enable_prefix_caching))
        self.requests: dict[str, Request] = {}
        self.last_schedule = None               # the SchedulerOutput of the latest step
        self._held_outputs: list[RequestOutput] = []   # other callers' outputs seen by generate()
        self._request_ids = itertools.count()
        self._seq_ids = itertools.count()
        self._seeds = random.Random(config.seed)

    def use_pool(self, pool) -> None:
        """Serve from ``pool`` (a :class:`~kvlab.paging.BlockPool` or one with its interface)."""
        if getattr(self, "requests", None):
            raise RuntimeError("the pool can only be replaced while no request is queued or running")
        if pool.num_blocks != self.model_runner.num_blocks or pool.block_size != self.engine_config.block_size:
            raise ValueError(f"the pool must have the cache's {self.model_runner.num_blocks} blocks of "
                             f"{self.engine_config.block_size} tokens, got {pool.num_blocks} of {pool.block_size}")
        c = self.engine_config
        self.pool = pool
        k = c.speculative_config.num_speculative_tokens if c.speculative_config else 0
        self.scheduler = Scheduler(pool, c.max_num_seqs, c.max_num_batched_tokens, c.max_model_len,
                                   self.config.eos_token_ids, num_lookahead_tokens=k,
                                   enable_chunked_prefill=c.enable_chunked_prefill,
                                   long_prefill_token_threshold=c.long_prefill_token_threshold,
                                   max_num_partial_prefills=c.max_num_partial_prefills,
                                   scheduling_policy=c.scheduling_policy,
                                   prefill_priority_after=c.prefill_priority_after,
                                   vocab_size=self.config.vocab_size, **self._host_tier(c))

    def _host_tier(self, c: EngineConfig) -> dict:
        """The scheduler's settings for the host tier (chapter 9): none without ``swap_space``.
        With prefix caching, the host blocks are shared out: the first half for swapped-out
        sequences, the rest for evicted prefix-cache blocks."""
        host = self.model_runner.host_cache
        if host is None:
            return {}
        bytes_per_token = host.bytes_per_block // c.block_size
        num_host = host.storage.shape[0]
        num_swap = num_host // 2 if isinstance(self.pool, BlockPool) and self.pool.enable_prefix_caching else num_host
        prefix = HostPrefixCache(range(num_swap, num_host)) if num_swap < num_host else None
        return dict(host_blocks=HostBlockAllocator(num_swap), preemption_mode=c.preemption_mode,
                    preemption_costs=default_costs(self.config, self.model_runner.device),
                    bytes_per_token=bytes_per_token, host_prefix_cache=prefix)

    def _load_draft(self, spec, config: EngineConfig, device):
        """The draft model of ``speculative_config``, checked against the target."""
        draft, _ = _load(spec.model if spec.model is not None else DEFAULT_DRAFT_MODEL, None, config.dtype, device)
        if draft.config.vocab_size != self.config.vocab_size:
            raise ValueError(f"speculative_config: the draft model's vocabulary has {draft.config.vocab_size} "
                             f"tokens, the target's {self.config.vocab_size}: they must share one tokenizer")
        if draft.config.max_position_embeddings < self.max_model_len:
            raise ValueError(f"speculative_config: the draft model's context ({draft.config.max_position_embeddings}) "
                             f"is shorter than max_model_len={self.max_model_len}")
        return draft

    def _make_proposer(self, spec, draft, config: EngineConfig):
        """The proposer of ``speculative_config`` (None without one); verification steps of
        k + 1 tokens per sequence get CUDA graphs of their own."""
        if spec is None:
            return None
        self.model_runner.capture_uniform_graphs(spec.num_speculative_tokens + 1)
        if draft is None:
            return NgramProposer(spec)
        runner = ModelRunner(draft, block_size=config.block_size, num_gpu_blocks=self.model_runner.num_blocks,
                             max_num_seqs=config.max_num_seqs, max_model_len=config.max_model_len,
                             attention_backend=config.attention_backend, enforce_eager=config.enforce_eager,
                             cudagraph_batch_sizes=config.cudagraph_batch_sizes())
        return DraftModelProposer(spec, runner)

    def get_tokenizer(self):
        return self.tokenizer

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (safe to call twice)."""
        if getattr(self, "_workers", None) is not None:
            self._workers.close()

    def __repr__(self) -> str:
        return (f"LLM({self.config.architecture}, {self.pool.num_blocks} blocks x {self.pool.block_size} tokens, "
                f"max_num_seqs={self.scheduler.max_num_seqs}, "
                f"max_num_batched_tokens={self.scheduler.max_num_batched_tokens}, "
                f"prefix_caching={self.pool.enable_prefix_caching})")

    # -- the batch API ---------------------------------------------------------------------
    def generate(self, prompts=None, sampling_params=None, use_tqdm: bool = True, *,
                 prompt_token_ids=None) -> list[RequestOutput]:
        """Complete every prompt; one :class:`RequestOutput` per prompt, in order.

        ``prompts``: a string, or a list of strings, token-id lists, or dicts with a
        ``"prompt"`` or ``"prompt_token_ids"`` key (and optionally a ``"cache_salt"``: requests
        of different salts never share a cached block); or pass ``prompt_token_ids`` (one list
        of ids or a list of them). ``sampling_params``: one for all, or one per prompt.

        Requests queued earlier with :meth:`add_request` run alongside; their outputs are not
        returned here but by the next :meth:`step`.
        """
        items = prompt_items(prompts, prompt_token_ids)
        params = params_per_prompt(sampling_params, len(items))
        requests = [self._build_request(item, p) for item, p in zip(items, params)]
        results = {r.request_id: self._output(r) for r in requests if r.error}
        for r in requests:
            if not r.error:
                r.params.output_kind = RequestOutputKind.FINAL_ONLY   # (r's own copy) generate returns finished outputs
                self._enqueue(r)
        bar = _progress_bar(len(requests) - len(results), use_tqdm)
        mine = {r.request_id for r in requests}
        while len(results) < len(requests):
            for output in self._step():
                if output.request_id not in mine:
                    self._held_outputs.append(output)      # another caller's: step() returns it
                elif output.finished and output.request_id not in results:
                    results[output.request_id] = output
                    bar.update(1)
        bar.close()
        return [results[r.request_id] for r in requests]

    def add_request(self, prompt, sampling_params: SamplingParams | None = None, request_id: str | None = None) -> str:
        """Queue one request (it runs on the following :meth:`step` calls); returns its id.
        Raises ValueError if the request cannot be served."""
        request = self._build_request(prompt_item(prompt), sampling_params or SamplingParams(), request_id)
        if request.error:
            raise request.exception
        self._enqueue(request)
        return request.request_id

    def abort_request(self, request_id) -> bool:
        """Stop a request now and free its blocks (vLLM's name); False if no such request runs.
        ``request_id`` may also be a list of ids: True if any was aborted."""
        if isinstance(request_id, (list, tuple, set)):
            return any([self.abort_request(rid) for rid in request_id])
        request = self.requests.pop(str(request_id), None)
        if request is None:
            return False
        for seq in request.seqs:
            if not seq.is_finished:
                self.scheduler.finish_sequence(seq, "abort")
        self._forget_drafts(request.seqs)
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (only while no request holds blocks); returns success."""
        return self.pool.reset_prefix_cache()

    # -- one step of the engine --------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run and sample one step; returns the outputs of the requests it advanced
        (and of those that finished while :meth:`generate` served other prompts). A request
        whose ``output_kind`` is ``RequestOutputKind.FINAL_ONLY`` has an output only once finished."""
        held, self._held_outputs = self._held_outputs, []
        return held + self._step()

    def _step(self) -> list[RequestOutput]:
        if self._workers is not None:
            self._workers.check_alive()          # a dead tensor-parallel engine refuses every step
        out = self.scheduler.schedule()
        self.last_schedule = out
        ended = list(out.finished)
        if out.blocks_to_swap_out or out.blocks_to_swap_in:
            try:
                self.model_runner.apply_swaps(out.blocks_to_swap_out, out.blocks_to_swap_in)
            except Exception as e:       # noqa: BLE001
                ended += self.scheduler.abandon(out, f"the step's swap failed: {type(e).__name__}: {e}")
                out.scheduled = []
        if out.scheduled:
            try:
                draft_probs = propose_drafts(self.proposer, self.scheduler, out, self.max_model_len) \
                    if self.proposer else None
                logits = self.model_runner.compute_logits(out)
                tokens, logprobs = self._sample(out, logits, draft_probs)
                # update checks the samples before it records anything: a sampler (yours, say) that
                # returns ids outside the vocabulary or too many tokens fails the step here
                num_before = [s.num_output_tokens for s in out.sample_seqs]
                finished = self.scheduler.update(out, tokens, logprobs)
            except EngineDeadError:
                raise
            except Exception as e:       # noqa: BLE001  (a failed step ends its requests, not the engine)
                ended += self.scheduler.abandon(out, f"the step failed: {type(e).__name__}: {e}")
            else:
                ended += finished
                self._after_verification(out, tokens)
                ended += self._check_stop_strings(out.sample_seqs, logprobs, num_before)
        elif not ended and not out.swapped_in and self.scheduler.has_unfinished():
            raise RuntimeError("the scheduler could not run anything: no request fits (a bug)")
        self._forget_drafts([*ended, *out.preempted])
        touched = [self.requests[rid] for rid in dict.fromkeys(s.request_id for s in [*out.sample_seqs, *ended])
                   if rid in self.requests]
        # An unfinished request that wants only its final output costs no decoding of text here.
        outputs = [self._output(r) for r in touched
                   if r.finished or r.params.output_kind is not RequestOutputKind.FINAL_ONLY]
        for o in outputs:
            if o.finished:
                del self.requests[o.request_id]
        return outputs

    def _sample(self, out, logits, draft_probs=None) -> tuple[list, list]:
        """Tokens and log-probabilities for every sample of the step (``out.sample_seqs`` order):
        one token each from the sampler, or, for a sequence verifying drafts, what rejection
        sampling emits."""
        samples, verifying = out.sample_seqs, [s for s in out.scheduled if s.spec_token_ids]
        if not verifying:
            return self._sample_rows(logits, samples)
        tokens, logprobs = [None] * len(samples), [None] * len(samples)
        plain, plain_rows, row = [], [], 0
        where = {id(seq): i for i, seq in enumerate(samples)}
        for item in out.scheduled:
            n = item.num_logits + len(item.forks)
            if n and not item.spec_token_ids:
                plain += [where[id(s)] for s in (item.seq, *item.forks)]
                plain_rows += range(row, row + n)
            row += n
        if plain:
            for i, t, lp in zip(plain, *self._sample_rows(logits[plain_rows], [samples[i] for i in plain])):
                tokens[i], logprobs[i] = [t], [lp]
        for item, (t, lp) in zip(verifying, verify_drafts(out, logits, draft_probs, self.rejection_sampler)):
            tokens[where[id(item.seq)]], logprobs[where[id(item.seq)]] = t, lp
        return tokens, logprobs

    def _sample_rows(self, logits, seqs) -> tuple[list[int], list[float]]:
        params = [s.params for s in seqs]
        sampled = self.sampler(logits, [p.temperature for p in params], [p.top_k for p in params],
                               [p.top_p for p in params], [s.generator for s in seqs])
        return sampled.tolist()

    def _after_verification(self, out, tokens) -> None:
        """Roll the draft's cache back to what was kept; count drafts proposed and kept."""
        if self.proposer is not None:
            record_verification(out, tokens, self.proposer, self.spec_decode_stats)

    def _forget_drafts(self, seqs) -> None:
        if self.proposer is not None:
            self.proposer.forget([s.seq_id for s in seqs])

    # -- requests ----------------------------------------------------------------------------
    def _build_request(self, item, params, request_id: str | None = None) -> Request:
        """A Request from one prompt item, with ``error`` set if it cannot be served."""
        if request_id is None:                     # an automatic id never takes one in use
            request_id = str(next(self._request_ids))
            while request_id in self.requests:
                request_id = str(next(self._request_ids))
        request = Request(str(request_id), None, None, params)
        try:
            if not isinstance(request_id, (str, int)) or isinstance(request_id, bool):
                raise TypeError(f"request_id must be a str or an int, got {type(request_id).__name__}")
            if request.request_id in self.requests:
                raise ValueError(f"request id {request.request_id!r} is already in use")
            request.prompt, request.prompt_token_ids, request.cache_salt = self._tokenize(item)
            if not isinstance(params, SamplingParams):
                raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
            # a copy, checked now: changing the caller's object later changes nothing here
            request.params = copy.deepcopy(params).validate()
            self._check_prompt(request.prompt_token_ids, request.params)
        except (ValueError, TypeError) as e:
            request.error, request.exception = str(e), e
        return request

    def _tokenize(self, item) -> tuple[str | None, list[int], str | bytes | None]:
        """``(prompt text, token ids, cache salt)`` of one prompt item."""
        kind, value, salt = item
        check_salt(salt)
        if kind == "text":
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompt_token_ids instead of text")
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(f"the prompt is not valid text: {e}") from None
            return value, list(self.tokenizer.encode(value).ids), salt
        if kind == "ids":
            return None, [as_token_id(t) for t in value], salt
        unknown = sorted(set(value) - PROMPT_KEYS) if isinstance(value, dict) else []
        if unknown:
            raise ValueError(f"a prompt dict takes the keys {sorted(PROMPT_KEYS)}, got {unknown}")
        hint = " (an array or a tensor: pass .tolist())" if hasattr(value, "tolist") else ""
        raise ValueError(f"a prompt must be a string, a list of token ids, or a dict with 'prompt' or "
                         f"'prompt_token_ids', got {value!r}{hint}")

    def _check_prompt(self, ids: list[int], params: SamplingParams) -> None:
        """Raise a ValueError for a prompt the engine cannot serve."""
        n, vocab, bs = len(ids), self.config.vocab_size, self.pool.block_size
        if n == 0:
            raise ValueError("the prompt is empty: a request needs at least one token")
        for i, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise ValueError(f"prompt token {i} is {t!r}, not a token id of this model (0..{vocab - 1})")
        if n >= self.max_model_len:
            raise ValueError(f"the prompt has {n} tokens but the model's context is {self.max_model_len} "
                             f"tokens: no room is left to generate")
        if blocks_needed(n, bs) > self.pool.num_blocks:
            raise ValueError(f"the prompt has {n} tokens, {blocks_needed(n, bs)} blocks of {bs}, but the whole "
                             f"KV cache has {self.pool.num_blocks} blocks")
        if n > self.scheduler.max_num_batched_tokens and not self.scheduler.enable_chunked_prefill:
            raise ValueError(f"the prompt has {n} tokens, more than max_num_batched_tokens="
                             f"{self.scheduler.max_num_batched_tokens}, and enable_chunked_prefill=False")
        if params.n > self.scheduler.max_num_seqs:
            raise ValueError(f"n={params.n} samples exceed max_num_seqs={self.scheduler.max_num_seqs}")

    def _enqueue(self, request: Request) -> None:
        """Make the request's n sequences; the first is scheduled, the others fork off it."""
        p = request.params
        request.seqs = [Sequence(next(self._seq_ids), request.request_id, request.prompt_token_ids, p, index=i,
                                 generator=self._generator(p, i)) for i in range(p.n)]
        request.seqs[0].forks = request.seqs[1:]
        for seq in request.seqs:
            seq.cache_salt = request.cache_salt
        self.requests[request.request_id] = request
        self.scheduler.add(request.seqs[0])

    def _generator(self, params: SamplingParams, index: int) -> torch.Generator | None:
        """Sample ``index``'s own RNG: seeded with ``seed + index``, or from the engine's seed."""
        if params.greedy:
            return None
        seed = params.seed + index if params.seed is not None else self._seeds.getrandbits(63)
        return self.model_runner.new_generator(seed % 2**63)

    # -- text ----------------------------------------------------------------------------------
    def _decode(self, seq: Sequence) -> str:
        """``seq``'s output as text, decoding only what is new since the last call."""
        return detokenize(self.tokenizer, seq.output_token_ids, seq.text_state)

    def _check_stop_strings(self, seqs: list[Sequence], logprobs: list, num_before: list[int]) -> list[Sequence]:
        """Finish the step's sequences whose text now holds one of their stop strings; returns
        those it finished. ``logprobs``: the step's, per sequence (a list: accepted drafts);
        ``num_before``: their output lengths before the step. As in vLLM, a stop string wins over
        ``max_tokens`` reached in the same step."""
        stopped = []
        for seq, step_logprobs, before in zip(seqs, logprobs, num_before):
            if not seq.params.stop_strings or (seq.is_finished and seq.finish_reason != "length"):
                continue
            hit = _first_stop(self._decode(seq), seq.params.stop_strings)
            if hit is None:
                continue
            emitted = seq.num_output_tokens - before
            if emitted > 1:
                self._cut_at_stop(seq, list(step_logprobs)[:emitted])
            if seq.is_finished:            # by max_tokens: already released, now a stop
                seq.finish("stop", stop_reason=hit[1])
            else:
                self.scheduler.finish_sequence(seq, "stop", stop_reason=hit[1])
                stopped.append(seq)
        return stopped

    def _cut_at_stop(self, seq: Sequence, step_logprobs: list[float]) -> None:
        """A step that emitted several tokens keeps those up to the one that completed the stop
        string, as steps of one token would have: speculation never changes the output."""
        out, stops = seq.output_token_ids, seq.params.stop_strings
        keep = len(out)                 # the text before this step had no stop string
        while keep > len(out) - len(step_logprobs) + 1 and \
                _first_stop(self.tokenizer.decode(out[:keep - 1], skip_special_tokens=True), stops) is not None:
            keep -= 1
        if keep < len(out):
            seq.drop_last_tokens(step_logprobs[keep - len(out):])
            seq.text_state = TextState()          # decoded again from the start, once

    def _text(self, seq: Sequence) -> str:
        text = self._decode(seq)
        if isinstance(seq.stop_reason, str):
            hit = _first_stop(text, seq.params.stop_strings)
            if hit is not None:
                text = text[:hit[0]]
        return text

    def _output(self, request: Request) -> RequestOutput:
        outputs = [CompletionOutput(s.index, self._text(s), s.output_token_ids, s.cumulative_logprob,
                                    s.finish_reason, s.stop_reason) for s in request.seqs]
        error = request.error or next((s.error for s in request.seqs if s.error), None)
        cached = request.seqs[0].num_cached_tokens if request.seqs else None
        stats = None
        if self.proposer is not None:
            stats = SpecDecodeStats()
            for s in request.seqs:
                stats = stats.add(s.spec_stats)
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, outputs,
                             request.finished, error, cached or 0, stats)


# -- helpers -------------------------------------------------------------------------------------
def _load(model, tokenizer, dtype, device):
    """``(model, tokenizer)`` from a checkpoint folder, a model object, or the default model."""
    from kvlab.models import LlamaForCausalLM, load_model

    if isinstance(model, LlamaForCausalLM):
        if dtype is not None:
            from kvlab.models.loader import resolve_dtype

            model = model.to(resolve_dtype(dtype))
        return model.eval(), tokenizer
    if model is None:
        if not DEFAULT_MODEL.is_dir():
            raise FileNotFoundError(f"the course's default model is not installed (expected at {DEFAULT_MODEL}); "
                                    f"pass LLM(model=<checkpoint folder>)")
        model = DEFAULT_MODEL
    loaded, loaded_tokenizer, _ = load_model(model, dtype=dtype, device=device, require_tokenizer=False)
    return loaded, tokenizer if tokenizer is not None else loaded_tokenizer


def _first_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    """``(index, stop)`` of the earliest stop string in ``text``, or None."""
    hits = [(text.find(s), s) for s in stops if s in text]
    return min(hits) if hits else None


def _progress_bar(total: int, use_tqdm: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="Processed prompts", unit="req", disable=not use_tqdm or total <= 1,
                dynamic_ncols=True)
