"""Tensor parallelism in the engine: one process per rank, this process rank 0.

``LLM(..., tensor_parallel_size=N)`` starts N - 1 worker processes (``torch.multiprocessing``,
spawned), one per rank, joined in one ``torch.distributed`` group: NCCL on GPUs (rank ``r`` on
GPU ``r``), gloo on CPUs. Each rank loads its own shard of the checkpoint
(:mod:`kvlab.models.parallel`) and allocates its own paged KV cache: the same block ids, its own
``KV / N`` KV heads, so a block costs each rank ``1/N`` of its bytes. A step::

    rank 0 (the engine)                                ranks 1 .. N-1 (workers)
    scheduler.schedule(): blocks booked in the pool
    the step's host lists (ids, positions, slots,   -> the same lists, over a pipe
    block tables, lengths, copy-on-write pairs)
    forward over its heads and its cache           <-> forward over theirs: all-reduces, and
    logits over the whole vocabulary                   an all-gather of the logits
    sampler, scheduler.update()                        (wait for the next step)

The scheduler and the block pool live on rank 0 only: every rank's cache has the same block
ids, so prefix caching, copy-on-write, preemption and chunked prefill need nothing more.

Why pipes for the schedule and not a collective: a worker must wait for the next step for as
long as the engine idles (a notebook left open), while every collective has a bounded timeout
(:data:`TIMEOUT_S`); the pipe also carries a worker's error back to rank 0.

**Failures.** Before each step rank 0 checks that every worker lives. A step that fails at
N > 1 (a worker died in a collective, or rank 0's own forward raised) leaves the ranks out of
step, so the engine stops: :class:`~kvlab.errors.EngineDeadError`, naming the rank that died.
:meth:`TensorParallelWorkers.close` (``LLM.close()``, and also when the engine is
garbage-collected or the interpreter exits) stops the workers and reaps them.

**CUDA graphs** at N > 1 are captured on every rank: the ranks build their runners with the
same settings, so they capture the same buckets in the same order (the NCCL collectives
inside each graph included), and each step's inputs pick the same bucket on every rank.
**Speculative decoding** is refused at N > 1 (:class:`~kvlab.engine.config.EngineConfig`).
One tensor-parallel engine runs in a process at a time (it owns the default process group).
On the CPU the ranks share the machine's cores, each (rank 0 too, until the engine closes)
with an equal share of torch's threads: more threads than cores make every rank crawl.
"""
from __future__ import annotations

import datetime
import os
import pickle
import socket
import time
import traceback
import weakref
from pathlib import Path

import torch
import torch.distributed as dist

from kvlab.engine.model_runner import ModelRunner
from kvlab.errors import EngineDeadError
from kvlab.models.parallel import ParallelContext, check_tensor_parallel_size

TIMEOUT_S = 300          # the longest any rank waits for another: a worker's start, a collective
STOP_TIMEOUT_S = 5       # how long a worker gets to exit before it is terminated


class TensorParallelWorkers:
    """Ranks 1 .. N-1 of a tensor-parallel engine: started, sent each step, watched, stopped.

    ``checkpoint``: a checkpoint folder (each rank reads its own shard of it). Joins this
    process to the group as rank 0; :attr:`tp` is its :class:`ParallelContext`."""

    def __init__(self, checkpoint, size: int, dtype=None, device="cpu"):
        self.checkpoint = checkpoint_folder(checkpoint, size)
        from kvlab.models import load_config

        check_tensor_parallel_size(size, load_config(self.checkpoint))
        if dist.is_available() and dist.is_initialized():
            raise RuntimeError("this process already has a torch.distributed group (another tensor-parallel "
                               "engine?): close it first (llm.close())")
        devices = rank_devices(device, size)
        backend = "nccl" if devices[0].type == "cuda" else "gloo"
        init = f"tcp://127.0.0.1:{free_port()}"
        self.dtype, self.device, self.dead, self.started = dtype, devices[0], None, False
        self.procs, self.conns = [], []
        spawn = torch.multiprocessing.get_context("spawn")
        for rank in range(1, size):
            ours, theirs = spawn.Pipe()
            proc = spawn.Process(target=_worker_main, name=f"kvlab-tp-rank{rank}", daemon=True,
                                 args=(theirs, rank, size, backend, init, devices[rank], self.checkpoint, dtype))
            proc.start()
            theirs.close()
            self.procs.append(proc)
            self.conns.append(ours)
        self._finalizer = weakref.finalize(self, _shutdown, self.procs, self.conns, torch.get_num_threads())
        if backend == "gloo":                # N ranks share the cores (oversubscribed, they crawl)
            torch.set_num_threads(threads_per_rank(size))
        try:
            self._expect("started")
            self.started = True
            if devices[0].type == "cuda":
                torch.cuda.set_device(devices[0])
            dist.init_process_group(backend, init_method=init, rank=0, world_size=size,
                                    timeout=datetime.timedelta(seconds=TIMEOUT_S))
        except BaseException:
            self.close()
            raise
        self.tp = ParallelContext(rank=0, size=size)

    def load_rank0(self, tokenizer=None):
        """``(model, tokenizer)``: rank 0's shard of the checkpoint, loaded in this process."""
        from kvlab.models import load_model

        try:
            model, loaded_tokenizer, _ = load_model(self.checkpoint, dtype=self.dtype, device=self.device,
                                                    require_tokenizer=False, tp=self.tp)
        except BaseException:
            self.close()
            raise
        return model.eval(), tokenizer if tokenizer is not None else loaded_tokenizer

    # -- talking to the workers ---------------------------------------------------------------
    def call(self, method: str, *args) -> None:
        """Have every worker run ``runner.method(*args)`` (they start as soon as it arrives)."""
        self.check_alive()
        message = pickle.dumps((method, args))
        try:
            for conn in self.conns:
                conn.send_bytes(message)
        except OSError as e:
            self._fail(e)

    def guard(self, fn, *args, **kwargs):
        """``fn(*args, **kwargs)``, the rank-0 half of a step: any failure stops the engine."""
        try:
            return fn(*args, **kwargs)
        except BaseException as e:      # noqa: BLE001  (the ranks are out of step: nothing can go on)
            self._fail(e)

    def check_alive(self) -> None:
        """Raise :class:`EngineDeadError` if a worker has exited (or the engine already failed)."""
        if self.dead is None:
            gone = [rank for rank, proc in enumerate(self.procs, 1) if not proc.is_alive()]
            if gone:
                self.dead = self._obituary(gone)
        if self.dead is not None:
            raise EngineDeadError(self.dead)

    def _fail(self, error: BaseException):
        """Stop the engine for good after ``error``: name the workers that died, if any did."""
        for proc in self.procs:
            proc.join(timeout=0.5)         # a worker that just died needs a moment to be reaped
        gone = [rank for rank, proc in enumerate(self.procs, 1) if not proc.is_alive()]
        if self.dead is None:
            self.dead = self._obituary(gone) if gone else \
                f"a tensor-parallel step failed on rank 0: {type(error).__name__}: {error}"
        raise EngineDeadError(self.dead) from error

    def _obituary(self, ranks: list[int]) -> str:
        """What happened to the workers of ``ranks``, in words (with their own error, if sent)."""
        lines, reported = [], False
        for rank in ranks:
            proc, conn = self.procs[rank - 1], self.conns[rank - 1]
            line = f"tensor-parallel worker rank {rank} (pid {proc.pid}) died, exit code {proc.exitcode}"
            report = _last_error(conn)
            reported = reported or report is not None
            lines.append(line + (f"; its error:\n{report}" if report else ""))
        text = "; ".join(lines)
        if not self.started and not reported:
            # a worker is a new interpreter that first imports the main module: a script that
            # builds the engine at its top level builds it again in there, and the worker dies
            text += ("; before it started. From a script, build the engine under "
                     "`if __name__ == \"__main__\":` (each worker imports the script again)")
        return text + ". The engine cannot go on: close it (llm.close()) and start a new one."

    def _expect(self, word: str) -> None:
        """Wait (bounded, watching that they live) until every worker has said ``word``."""
        deadline = time.monotonic() + TIMEOUT_S
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns), 1):
            while not conn.poll(0.05):
                self.check_alive()
                if time.monotonic() > deadline:
                    raise EngineDeadError(f"tensor-parallel worker rank {rank} did not report {word!r} "
                                          f"within {TIMEOUT_S} s")
            try:
                kind, *rest = conn.recv()
            except EOFError:
                proc.join(timeout=1)
                self.check_alive()
                raise
            if kind == "error":
                self.dead = f"tensor-parallel worker rank {rank} failed:\n{rest[0]}"
                raise EngineDeadError(self.dead)

    def close(self) -> None:
        """Stop every worker, reap it, and leave the process group (safe to call twice)."""
        self._finalizer()


class TensorParallelRunner(ModelRunner):
    """Rank 0's :class:`ModelRunner`: every call that touches the model or the cache goes to
    the workers first, so all ranks run it together."""

    def __init__(self, workers: TensorParallelWorkers, model, **settings):
        self.workers = workers
        try:
            workers.call("build_runner", settings)
            workers._expect("loaded")
            workers.guard(super().__init__, model, **settings)
        except BaseException:
            workers.close()
            raise

    def apply_copies(self, pairs: list[tuple[int, int]]) -> None:
        if pairs:
            self.workers.call("apply_copies", pairs)
            self.workers.guard(super().apply_copies, pairs)

    def apply_swaps(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        if swap_out or swap_in:             # each rank moves its own KV heads of the blocks
            self.workers.call("apply_swaps", swap_out, swap_in)
            self.workers.guard(super().apply_swaps, swap_out, swap_in)

    def run(self, ids, positions, tables, starts, query_lens, slots, rows) -> torch.Tensor:
        args = (ids, positions, tables, starts, query_lens, slots, rows)
        self.workers.call("run", *args)
        return self.workers.guard(super().run, *args)


# -- a worker ------------------------------------------------------------------------------------
def _worker_main(conn, rank: int, size: int, backend: str, init: str, device: torch.device, checkpoint, dtype):
    """One worker's life: join the group, load its shard, then run what rank 0 sends until
    told to stop (or until rank 0 is gone: its end of the pipe closes)."""
    try:
        torch.set_num_threads(threads_per_rank(size))
        if device.type == "cuda":
            torch.cuda.set_device(device)
        conn.send(("started",))
        dist.init_process_group(backend, init_method=init, rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=TIMEOUT_S))
        from kvlab.models import load_model

        model, _, _ = load_model(checkpoint, dtype=dtype, device=device, require_tokenizer=False,
                                 tp=ParallelContext(rank=rank, size=size))
        conn.send(("loaded",))
        runner = None
        while True:
            try:
                method, args = pickle.loads(conn.recv_bytes())
            except EOFError:
                break
            if method == "close":
                break
            if method == "build_runner":
                runner = ModelRunner(model, **args[0])
            else:
                getattr(runner, method)(*args)
    except BaseException:  # noqa: BLE001  (report it to rank 0, then exit non-zero)
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:
            pass
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _shutdown(procs, conns, threads: int) -> None:
    """Tell every worker to stop, wait for it (then terminate, then kill), leave the group,
    give this process its threads back."""
    for conn in conns:
        try:
            conn.send_bytes(pickle.dumps(("close", ())))
        except OSError:
            pass
    for proc in procs:
        proc.join(timeout=STOP_TIMEOUT_S)
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=STOP_TIMEOUT_S)
        if proc.is_alive():
            proc.kill()
            proc.join()
    for conn in conns:
        conn.close()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    torch.set_num_threads(threads)


def _last_error(conn) -> str | None:
    """The error a worker sent before it exited, if any is waiting on the pipe."""
    report = None
    try:
        while conn.poll(0):
            kind, *rest = conn.recv()
            if kind == "error":
                report = rest[0]
    except (EOFError, OSError):
        pass
    return report


# -- helpers -----------------------------------------------------------------------------------------
def checkpoint_folder(model, size: int) -> Path:
    """The checkpoint folder every rank loads its shard from (the course's model by default)."""
    from kvlab.engine.llm import DEFAULT_MODEL

    if model is None:
        model = DEFAULT_MODEL
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"tensor_parallel_size={size} needs a checkpoint folder (each rank loads its own shard of "
                        f"it), got a {type(model).__name__}")
    return Path(model)


def rank_devices(device, size: int) -> list[torch.device]:
    """The device of each rank: the CPU for all, or GPUs ``i, i + 1, ...`` from ``device`` = cuda:i."""
    device = torch.device(device)
    if device.type != "cuda":
        return [device] * size
    first = device.index or 0
    if first + size > torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size={size} needs {size} GPUs from cuda:{first}, but this machine has "
                         f"{torch.cuda.device_count()}")
    return [torch.device("cuda", first + rank) for rank in range(size)]


def threads_per_rank(size: int) -> int:
    """CPU threads each of ``size`` ranks on one machine gets: an equal share of the cores."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // size)


def free_port() -> int:
    """A TCP port free on this machine now, for the group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
