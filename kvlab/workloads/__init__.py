"""The chapters' workloads: what each chapter runs on the engine's pieces, and what it measures.

* ``allocation``: contiguous vs paged KV allocation simulated on a request trace (chapter 1);
* ``allocator_trace``: allocator event traces, replayed on any pool as page-map frames (chapter 2);
* ``beam_search``: parallel sampling and beam search on a copy-on-write pool (chapter 3);
* ``prefix``: prefix-caching workloads served by a real pool, and what the cache saved (chapter 4);
* ``attention_memory``: the score matrix of naive attention, computed and measured (chapter 5);
* ``speculation``: speculative decoding's arithmetic, sampler exactness and acceptance (chapter 7);
* ``code_prompts``: the held-out code prompts chapter 7 times speculative decoding on;
* ``serving``: request traces, TTFT/ITL metrics and the step-cost model (chapter 8);
* ``replay``: a trace replayed on the real scheduler in virtual time, or on an engine (chapter 8);
* ``batching``: chapter 8's recorded schedules and experiment replays, for its figures.

Import the module you need (``from kvlab.workloads.prefix import run_workload``); nothing is
imported here.
"""
