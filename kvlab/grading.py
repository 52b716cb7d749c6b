"""Graded exercises: load a chapter's implementation, grade it, or fall back to the solution.

Each chapter's tasks are stubs in ``exercises/chNN.py`` and answers in ``solutions/chNN.py``;
one test suite, ``tests/graded/``, grades either (``pytest -m ch02 --impl=exercises``).
Grading runs in a fresh process, in the Triton interpreter on the CPU, so it sees your
latest edits and gives Python-level errors from inside kernels.
"""
from __future__ import annotations

import importlib
import json
import linecache
import os
import re
import signal
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

# The course checkout; the grader points its test processes at the one it grades.
ROOT = Path(os.environ.get("KVLAB_GRADE_ROOT") or Path(__file__).resolve().parent.parent)
IMPLS = ("exercises", "solutions")
CHAPTERS = {
    "ch01": "KV memory accounting",
    "ch02": "Paged block tables",
    "ch03": "Copy-on-write",
    "ch04": "Prefix caching",
    "ch05": "FlashAttention",
    "ch06": "FlashDecoding",
    "ch07": "Speculative decoding",
    "ch08": "Continuous batching",
}


def _check_chapter(chapter: str) -> str:
    if chapter not in CHAPTERS:
        raise ValueError(f"chapter must be one of {sorted(CHAPTERS)}, got {chapter!r}")
    return chapter


def load_chapter(chapter: str, impl: str = "exercises", reload: bool = False):
    """The module ``exercises.chNN`` (your code) or ``solutions.chNN`` (the answers).

    ``reload=True`` re-reads the file, so a notebook sees your latest edits.
    """
    _check_chapter(chapter)
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if not (ROOT / impl / f"{chapter}.py").exists():
        raise FileNotFoundError(f"{impl}/{chapter}.py not found under {ROOT}: kvlab must be installed "
                                "from a checkout of the course (pip install -e .)")
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    module = importlib.import_module(f"{impl}.{chapter}")
    return importlib.reload(module) if reload else module


# Tasks whose tests launch the learner's Triton kernel, and the kernel: each runs in a process of
# its own, so a kernel that kills the interpreter fails its task and the other tasks still report.
KERNEL_TASKS = {
    "ch02": {"write_kv_kernel": "write_kv_kernel"},
    "ch05": {"online_softmax": "online_softmax_update (in attention_kernel)"},
    "ch06": {"merge_kernel": "merge_splits_kernel"},
}
CRASH_HINT = ("This is usually an out-of-bounds load or store: a slot of -1 (padding) that is not masked "
              "off, or a load/store without a mask past the end of a row.")
GRADE_TIMEOUT_S = 300      # per process: a learner's endless loop fails the tasks instead of hanging
_MESSAGE_LINES = 5
_FAILURES_SHOWN = 2


@dataclass
class Failure:
    test: str
    message: str = ""
    where: str = ""          # "exercises/ch02.py:80: <source line>" when the traceback went through it

    def lines(self) -> list[str]:
        out = [self.test]
        out += ["  " + line for line in _short_message(self.message)]
        if self.where and "raise NotImplementedError" not in self.where:   # a stub: the message says it
            out.append(f"  at {self.where}")
        return out


@dataclass
class TaskResult:
    task: str
    passed: int = 0
    failed: int = 0
    first_failure: str = ""
    failures: list[Failure] = field(default_factory=list)
    crashed: bool = False
    not_run: int = 0         # tests after a crash

    @property
    def ok(self) -> bool:
        return self.failed == 0 and self.passed > 0

    def add_failure(self, failure: Failure) -> None:
        self.failed += 1
        self.failures.append(failure)
        if not self.first_failure:
            first = failure.message.strip().splitlines()
            self.first_failure = first[0][:300] if first else "failed"


def _short_message(message: str) -> list[str]:
    """The first lines of a failure, pytest's ``assert got == want`` as got/expected."""
    lines = []
    for line in message.strip().splitlines():
        text = line.strip()
        if not text:
            continue
        if text.startswith(("Use -v", "Full diff", "Omitting")) or len(lines) >= _MESSAGE_LINES:
            break
        if text.startswith("assert ") and " == " in text and not text.startswith("assert ("):
            got, want = text[len("assert "):].split(" == ", 1)
            lines += [f"got:      {got}"[:200], f"expected: {want}"[:200]]
            continue
        lines.append(text if len(text) <= 200 else text[:197] + "...")
    return lines


@dataclass
class GradeReport:
    chapter: str
    impl: str
    tasks: list[TaskResult] = field(default_factory=list)
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and bool(self.tasks) and all(t.ok for t in self.tasks)

    def table(self) -> str:
        lines = [f"{self.chapter} - {CHAPTERS[self.chapter]}  (graded: {self.impl}/{self.chapter}.py)"]
        for t in self.tasks:
            mark = "PASS" if t.ok else "FAIL"
            total = f"{t.passed}/{t.passed + t.failed} tests"
            if t.crashed:
                total += ", CRASHED"
            lines.append(f"  {mark}  {t.task:<22} {total}")
            shown, seen = 0, set()
            # the first failure, then those whose traceback went through the graded file
            for failure in t.failures[:1] + sorted(t.failures[1:], key=lambda f: not f.where):
                key = failure.message.strip().splitlines()[:1]
                if tuple(key) in seen:
                    continue
                seen.add(tuple(key))
                if shown == _FAILURES_SHOWN:
                    break
                lines += ["        " + line for line in failure.lines()]
                shown += 1
            more = t.failed - t.not_run - shown
            if more > 0:
                lines.append(f"        (+{more} more failing tests)")
            if t.not_run:
                lines.append(f"        ({t.not_run} more tests did not run after the crash)")
        if self.error:
            lines.append(f"  could not run the tests: {self.error}")
        n_ok = sum(t.ok for t in self.tasks)
        lines.append(f"{n_ok}/{len(self.tasks)} tasks pass")
        return "\n".join(lines)

    def __repr__(self) -> str:
        n_ok = sum(t.ok for t in self.tasks)
        return f"GradeReport({self.chapter}, {self.impl}: {n_ok}/{len(self.tasks)} tasks pass)"


def _task_order(test_file: Path) -> list[str]:
    return list(dict.fromkeys(re.findall(r"""mark\.task\(\s*["']([^"']+)["']""", test_file.read_text())))


def grade(chapter: str, impl: str = "exercises") -> GradeReport:
    """Run the chapter's graded tests on ``impl`` in fresh processes; returns per-task results.

    The tasks without a Triton kernel run in one process; each kernel task in its own, in parallel,
    so a kernel that kills the process (an out-of-bounds store, say) fails only its own task.
    """
    _check_chapter(chapter)
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    test_file = ROOT / "tests" / "graded" / f"test_{chapter}.py"
    env = dict(os.environ, KVLAB_PROFILE="cpu", TRITON_INTERPRET="1", KVLAB_IMPL=impl, KVLAB_GRADE_ROOT=str(ROOT),
               PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")     # no notebook or other plugins: starts ~2 s sooner
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    for variable in ("KVLAB_GRADE_TASKS", "KVLAB_GRADE_SKIP_TASKS", "KVLAB_GRADE_PROGRESS"):
        env.pop(variable, None)
    kernels = KERNEL_TASKS.get(chapter, {})
    report = GradeReport(chapter, impl)
    with tempfile.TemporaryDirectory() as tmp:
        runs = []
        groups = [(None, {"KVLAB_GRADE_SKIP_TASKS": ",".join(kernels)})]
        groups += [(task, {"KVLAB_GRADE_TASKS": task}) for task in kernels]
        for i, (task, select) in enumerate(groups):
            xml_path, progress = Path(tmp) / f"report{i}.xml", Path(tmp) / f"progress{i}.txt"
            cmd = [sys.executable, "-X", "faulthandler", "-m", "pytest", str(test_file), "-m", chapter,
                   f"--impl={impl}", "-q", "-p", "no:cacheprovider", f"--junitxml={xml_path}",
                   "-o", "junit_family=xunit1"]
            out = open(Path(tmp) / f"output{i}.txt", "w+")
            proc = subprocess.Popen(cmd, cwd=ROOT, env=dict(env, KVLAB_GRADE_PROGRESS=str(progress), **select),
                                    stdout=out, stderr=subprocess.STDOUT, text=True)
            runs.append((task, proc, xml_path, progress, out))
        results: dict[str, TaskResult] = {}
        deadline = time.monotonic() + GRADE_TIMEOUT_S
        for task, proc, xml_path, progress, out in runs:
            try:
                returncode = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                returncode = proc.wait()
                out.write(f"\nTIMEOUT: still running after {GRADE_TIMEOUT_S} s (an endless loop?)\n")
            out.seek(0)
            output = out.read()
            out.close()
            if xml_path.exists():
                for result in _parse_junit(xml_path):
                    results[result.task] = result
            elif task is not None:
                results[task] = _crash_result(chapter, impl, task, kernels[task], returncode, output, progress)
            else:
                last = output.strip().splitlines()[-1:] or ["pytest failed to start"]
                report.error = last[0] + (f" (the process died: {_signal_name(returncode)})" if returncode < 0 else "")
        order = _task_order(test_file)
        report.tasks = sorted(results.values(), key=lambda t: order.index(t.task) if t.task in order else len(order))
        if not report.tasks and not report.error:
            report.error = "no graded tests were collected"
    return report


def _signal_name(returncode: int) -> str:
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


def _crash_result(chapter, impl, task, kernel, returncode, output, progress: Path) -> TaskResult:
    """The task whose process died: name the kernel, the test, and the line it was running."""
    result = TaskResult(task, crashed=True)
    running, collected = "", 0
    if progress.exists():
        for line in progress.read_text().splitlines():
            state, _, nodeid = line.partition(" ")
            if state == "collected":
                collected = int(nodeid)
            elif state == "start":
                running = nodeid
            elif state == "passed":
                result.passed += 1
            elif state == "failed":
                result.failed += 1
    how = _signal_name(returncode) if returncode < 0 else f"exit status {returncode}"
    fatal = next((line.strip() for line in output.splitlines() if line.startswith(("Fatal Python error", "TIMEOUT"))),
                 "")
    message = (f"CRASH: the grading process died ({fatal or how}) while running your kernel {kernel}.\n"
               f"{CRASH_HINT}")
    # faulthandler prints the stack, innermost first: the first frame in the graded file
    where = ""
    for match in re.finditer(r'File "([^"]+)", line (\d+)', output):
        path = Path(match.group(1))
        if path.parent.name == impl and path.name == f"{chapter}.py":
            line = linecache.getline(str(path), int(match.group(2))).strip()
            where = f"{impl}/{path.name}:{match.group(2)}: {line}"
            break
    result.add_failure(Failure(running.rpartition("::")[2] or f"the {task} tests", message, where))
    result.not_run = max(0, collected - result.passed - result.failed)    # failed: those before, and this one
    result.failed += result.not_run
    return result


def _parse_junit(path: Path) -> list[TaskResult]:
    results: dict[str, TaskResult] = {}
    for case in ET.parse(path).iter("testcase"):
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        task = props.get("task", case.get("name"))
        result = results.setdefault(task, TaskResult(task))
        problem = case.find("failure")
        if problem is None:
            problem = case.find("error")
        if problem is None and case.find("skipped") is None:
            result.passed += 1
        elif problem is not None:
            message = _json_prop(props, "message") or (problem.get("message") or problem.text or "failed")
            result.add_failure(Failure(case.get("name"), message, _json_prop(props, "where")))
    return list(results.values())


def _json_prop(props: dict, name: str) -> str:
    try:
        return json.loads(props[name]) if props.get(name) else ""
    except ValueError:
        return props[name]


def check(chapter: str, impl: str = "exercises") -> GradeReport:
    """Grade a chapter from a notebook: prints the per-task table and returns the report."""
    report = grade(chapter, impl)
    print(report.table())
    return report


def solution_tasks(chapter: str) -> list[str]:
    """The task names of a chapter, in the order its solution file gives them."""
    _check_chapter(chapter)
    text = (ROOT / "solutions" / f"{chapter}.py").read_text()
    return re.findall(r"^# -- task (\w+)", text, flags=re.M)


def solution_source(chapter: str, task: str) -> str:
    """The reference answer of one task: its section of ``solutions/chNN.py``."""
    tasks = solution_tasks(chapter)
    if task not in tasks:
        raise ValueError(f"task must be one of {chapter}'s tasks {tasks}, got {task!r}")
    text = (ROOT / "solutions" / f"{chapter}.py").read_text()
    section = re.split(r"^# -- task (\w+).*$", text, flags=re.M)
    body = dict(zip(section[1::2], section[2::2]))[task]
    return f"# {chapter}, task {task}: the reference answer (solutions/{chapter}.py)\n" + body.strip() + "\n"


def show_solution(chapter: str, task: str) -> str:
    """Print a task's reference answer: the explicit reveal, for after your own attempt."""
    source = solution_source(chapter, task)
    print(source)
    return source


def use_solution(chapter: str) -> Path:
    """Make ``exercises/chNN.py`` the reference answer; your version is kept beside it.

    Use it when stuck: later chapters that build on this one then run on working code.
    Your file is saved as ``exercises/chNN_mine.py`` (``_mine2``... if that exists).
    """
    _check_chapter(chapter)
    mine, answer = ROOT / "exercises" / f"{chapter}.py", ROOT / "solutions" / f"{chapter}.py"
    backup = ROOT / "exercises" / f"{chapter}_mine.py"
    n = 1
    while backup.exists():
        n += 1
        backup = ROOT / "exercises" / f"{chapter}_mine{n}.py"
    shutil.copyfile(mine, backup)
    shutil.copyfile(answer, mine)
    sys.modules.pop(f"exercises.{chapter}", None)
    print(f"exercises/{chapter}.py now holds the reference solution; your version is in exercises/{backup.name}")
    return backup
