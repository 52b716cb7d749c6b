"""kvlab: build an LLM serving engine's KV cache, chapter by chapter.

>>> from kvlab import LLM, SamplingParams                                     # doctest: +SKIP
>>> LLM().generate("def add(a, b):", SamplingParams(temperature=0))[0].outputs[0].text  # doctest: +SKIP

Importing kvlab first picks the profile (see :mod:`kvlab.profile`): without a CUDA device
it sets ``TRITON_INTERPRET=1`` so the course's Triton kernels run on the CPU.
"""
from kvlab import profile  # must come first: it sets TRITON_INTERPRET before triton loads
from kvlab.errors import KVLabError, OutOfBlocksError, SharedBlockWriteError, UnknownSequenceError

__version__ = "0.1.0"


def check(chapter: str, impl: str = "exercises"):
    """Grade a chapter's exercises in the notebook: prints pass/fail per task."""
    from kvlab.grading import check as _check

    return _check(chapter, impl=impl)


def load_exercise(chapter: str):
    """Your ``exercises/chNN.py``, freshly re-read: ``mine = kvlab.load_exercise("ch02")``."""
    from kvlab.grading import load_chapter

    return load_chapter(chapter, "exercises", reload=True)


def use_solution(chapter: str):
    """Load a chapter's reference solution as your checkpoint (your version is kept)."""
    from kvlab.grading import use_solution as _use_solution

    return _use_solution(chapter)


def show_solution(chapter: str, task: str) -> None:
    """Print one task's reference answer, after your attempt: ``kvlab.show_solution("ch02", "write_kv_kernel")``."""
    from kvlab.grading import show_solution as _show_solution

    _show_solution(chapter, task)


def doctor(verbose: bool = True) -> bool:
    """Check the environment: versions, profile, a tiny Triton kernel against torch."""
    from kvlab.doctor import doctor as _doctor

    return _doctor(verbose=verbose)


def __getattr__(name: str):
    """``from kvlab import LLM, SamplingParams`` (vLLM's import), loaded on first use."""
    if name in ("LLM", "SamplingParams", "EngineConfig"):
        import kvlab.engine

        return getattr(kvlab.engine, name)
    raise AttributeError(f"module 'kvlab' has no attribute {name!r}")


__all__ = ["LLM", "SamplingParams", "EngineConfig", "profile", "KVLabError", "OutOfBlocksError", "SharedBlockWriteError", "UnknownSequenceError", "check", "load_exercise",
           "use_solution", "show_solution", "doctor"]
