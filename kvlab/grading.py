"""Graded exercises: load a chapter's implementation, grade it, or fall back to the solution.

Each chapter's tasks are stubs in ``exercises/chNN.py`` and answers in ``solutions/chNN.py``;
one test suite, ``tests/graded/``, grades either (``pytest -m ch02 --impl=exercises``).
Grading runs in a fresh process, in the Triton interpreter on the CPU, so it sees your
latest edits and gives Python-level errors from inside kernels.
"""
from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
IMPLS = ("exercises", "solutions")
CHAPTERS = {
    "ch01": "KV memory accounting",
    "ch02": "Paged block tables",
    "ch03": "Copy-on-write",
    "ch04": "Prefix caching",
    "ch05": "FlashAttention",
    "ch06": "FlashDecoding",
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


@dataclass
class TaskResult:
    task: str
    passed: int = 0
    failed: int = 0
    first_failure: str = ""

    @property
    def ok(self) -> bool:
        return self.failed == 0 and self.passed > 0


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
            line = f"  {mark}  {t.task:<22} {t.passed}/{t.passed + t.failed} tests"
            if t.first_failure:
                line += f"\n        first failure: {t.first_failure}"
            lines.append(line)
        if self.error:
            lines.append(f"  could not run the tests: {self.error}")
        n_ok = sum(t.ok for t in self.tasks)
        lines.append(f"{n_ok}/{len(self.tasks)} tasks pass")
        return "\n".join(lines)

    def __repr__(self) -> str:
        n_ok = sum(t.ok for t in self.tasks)
        return f"GradeReport({self.chapter}, {self.impl}: {n_ok}/{len(self.tasks)} tasks pass)"


def grade(chapter: str, impl: str = "exercises") -> GradeReport:
    """Run the chapter's graded tests on ``impl`` in a fresh process; returns per-task results."""
    _check_chapter(chapter)
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    env = dict(os.environ, KVLAB_PROFILE="cpu", TRITON_INTERPRET="1", KVLAB_IMPL=impl)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    with tempfile.TemporaryDirectory() as tmp:
        xml_path = Path(tmp) / "report.xml"
        cmd = [sys.executable, "-m", "pytest", str(ROOT / "tests" / "graded"), "-m", chapter, f"--impl={impl}",
               "-q", "-p", "no:cacheprovider", f"--junitxml={xml_path}", "-o", "junit_family=xunit1"]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        report = GradeReport(chapter, impl)
        if not xml_path.exists():
            report.error = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or ["pytest failed to start"]
            report.error = report.error[0]
            return report
        report.tasks = _parse_junit(xml_path)
        if not report.tasks:
            report.error = "no graded tests were collected"
    return report


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
            result.failed += 1
            if not result.first_failure:
                message = (problem.get("message") or problem.text or "").strip()
                result.first_failure = message.splitlines()[0][:300] if message else "failed"
    return list(results.values())


def check(chapter: str, impl: str = "exercises") -> GradeReport:
    """Grade a chapter from a notebook: prints the per-task table and returns the report."""
    report = grade(chapter, impl)
    print(report.table())
    return report


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
