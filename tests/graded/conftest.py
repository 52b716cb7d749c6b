"""Fixtures of the graded suite: ``ch01``, ``ch02``... are the implementation under test.

``kvlab.check`` / ``kvlab grade`` read what these hooks record: each test's task, and for a
failure a short message (expected vs got) and the line of the graded file it went through.
"""
import json
import linecache
import os
from collections import Counter
from pathlib import Path

import pytest
import torch

from kvlab.grading import CHAPTERS, ROOT, load_chapter


@pytest.fixture(scope="session")
def impl(request) -> str:
    return request.config.getoption("--impl")


def _chapter_fixture(chapter):
    @pytest.fixture(name=chapter)
    def fixture(impl):
        return load_chapter(chapter, impl)
    return fixture


for _chapter in CHAPTERS:
    globals()[_chapter] = _chapter_fixture(_chapter)


def _task_of(item):
    marker = item.get_closest_marker("task")
    return marker.args[0] if marker is not None else None


@pytest.fixture(autouse=True)
def _record_task(request, record_property):
    """Put each test's task name into the JUnit report that kvlab.check reads."""
    task = _task_of(request.node)
    if task is not None:
        record_property("task", task)


def _names(variable: str) -> set[str]:
    return {name for name in os.environ.get(variable, "").split(",") if name}


def pytest_collection_modifyitems(config, items):
    """``KVLAB_GRADE_TASKS`` / ``KVLAB_GRADE_SKIP_TASKS`` (comma-separated): run only / all but
    these tasks (the grader runs groups of tasks in processes of their own)."""
    only, skip = _names("KVLAB_GRADE_TASKS"), _names("KVLAB_GRADE_SKIP_TASKS")
    if not only and not skip:
        return
    keep, drop = [], []
    for item in items:
        task = _task_of(item)
        (keep if (not only or task in only) and task not in skip else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


# -- progress, for the grader when a process dies ----------------------------------------------
_TASK_OF_TEST: dict[str, str] = {}


def _progress(state: str, task: str, what) -> None:
    """Append ``state task what`` to ``KVLAB_GRADE_PROGRESS``: if a kernel kills the process,
    the grader still knows which test of which task it was running, and how far each task got."""
    progress = os.environ.get("KVLAB_GRADE_PROGRESS")
    if progress:
        with open(progress, "a") as f:
            f.write(f"{state} {task} {what}\n")


def pytest_collection_finish(session):
    _TASK_OF_TEST.update((item.nodeid, _task_of(item) or "-") for item in session.items)
    for task, count in Counter(_TASK_OF_TEST.values()).items():
        _progress("collected", task, count)


def pytest_runtest_logstart(nodeid, location):
    _progress("start", _TASK_OF_TEST.get(nodeid, "-"), nodeid)


def pytest_runtest_logreport(report):
    if report.when == "call" or (report.when == "setup" and report.failed):
        _progress(report.outcome, _TASK_OF_TEST.get(report.nodeid, "-"), report.nodeid)


# -- what went wrong, for the grader's table ---------------------------------------------------
def _graded_dir(config) -> Path:
    return (ROOT / config.getoption("--impl")).resolve()


def _exception_chain(exc):
    seen = []
    while exc is not None and exc not in seen:
        seen.append(exc)
        exc = exc.__cause__ or exc.__context__
    return seen


def _where(excinfo, graded: Path) -> str:
    """``exercises/ch02.py:80: <source>`` of the deepest frame in the graded file, or ''."""
    found = ""
    for exc in _exception_chain(excinfo.value):   # the original error (inside a kernel, say) last
        tb = exc.__traceback__
        while tb is not None:
            filename = tb.tb_frame.f_code.co_filename
            try:
                inside = Path(filename).resolve().parent == graded
            except (OSError, ValueError):
                inside = False
            if inside:
                line = linecache.getline(filename, tb.tb_lineno).strip()
                found = f"{graded.name}/{Path(filename).name}:{tb.tb_lineno}: {line}"
            tb = tb.tb_next
    return found


def _message(excinfo) -> str:
    exc = excinfo.value
    # An error inside a Triton kernel reaches the test as InterpreterError(repr(original)):
    # show the original, which is what the learner raised or got wrong.
    if type(exc).__name__ == "InterpreterError" and exc.__cause__ is not None:
        cause = exc.__cause__
        while type(cause).__name__ == "InterpreterError" and cause.__cause__ is not None:   # a kernel's @jit call
            cause = cause.__cause__
        return f"{type(cause).__name__}: {cause} (inside the Triton kernel)"
    return excinfo.exconly()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    # (on the item: JUnit takes the properties from the teardown report)
    if call.excinfo is None or not report.failed or _task_of(item) is None:
        return
    try:
        item.user_properties.append(("message", json.dumps(_message(call.excinfo))))
        where = _where(call.excinfo, _graded_dir(item.config))
        if where:
            item.user_properties.append(("where", json.dumps(where)))
    except Exception:           # the table loses a detail; the test's own result stands
        pass


# -- out-of-bounds stores ----------------------------------------------------------------------
class OutputGuard:
    """Output buffers with canaries before and after, to catch a kernel storing out of bounds.

    In the CPU interpreter a store past the end of a tensor lands in whatever memory is there:
    it passes silently or kills the process. ``guard.full(...)`` returns a tensor that is a view
    into a larger buffer; ``guard.check()`` fails if the kernel wrote into the margins.
    """

    CANARY = -7777.0

    def __init__(self):
        self._buffers = []

    def full(self, shape, fill, *, dtype=torch.float32, device="cpu", name="out"):
        numel = 1
        for n in shape:
            numel *= n
        pad = max(1024, numel)
        buffer = torch.full((pad + numel + pad,), self.CANARY, dtype=dtype, device=device)
        inner = buffer[pad:pad + numel].view(*shape)
        inner.fill_(fill)
        self._buffers.append((name, buffer, pad, numel))
        return inner

    def check(self):
        for name, buffer, pad, numel in self._buffers:
            canary = torch.tensor(self.CANARY, dtype=buffer.dtype).to(buffer.device)
            before, after = buffer[:pad], buffer[pad + numel:]
            if not bool((after == canary).all()):
                first = int((after != canary).nonzero()[0])
                raise AssertionError(f"your kernel wrote past the end of `{name}` (element {numel + first} of a "
                                     f"tensor of {numel}): check the store mask")
            if not bool((before == canary).all()):
                first = int((before != canary).nonzero()[0])
                raise AssertionError(f"your kernel wrote before the start of `{name}` (from element {first - pad}): "
                                     "check the store mask (a slot of -1 must store nothing)")


@pytest.fixture
def guard():
    """``out = guard.full(shape, nan, ...)``, launch the kernel, then ``guard.check()``."""
    return OutputGuard()


def pytest_terminal_summary(terminalreporter, config):
    """Say which implementation was graded: without ``--impl`` it is the reference answers."""
    ran = any(reports for key, reports in terminalreporter.stats.items() if key in ("passed", "failed", "error"))
    if ran and config.getoption("--impl") == "solutions":
        terminalreporter.write_line("the graded tests ran on solutions/, the reference answers; to grade your own "
                                    "work: --impl=exercises (or `kvlab grade chNN`)")
