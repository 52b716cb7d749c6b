"""Graded exercises: load a chapter's implementation, grade it, or fall back to the solution.

Each chapter's tasks are stubs in ``exercises/chNN.py`` and answers in ``solutions/chNN.py``;
one test suite, ``tests/graded/``, grades either (``pytest -m ch02 --impl=exercises``).
Grading runs in a fresh process, in the Triton interpreter on the CPU, so it sees your
latest edits and gives Python-level errors from inside kernels. That process
(:mod:`kvlab.grade_runner`) imports torch, Triton and pytest once, then forks a child for each
kernel task and one or more for the other tasks, one per CPU core.
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import linecache
import os
import re
import signal
import shutil
import subprocess
import sys
import tempfile
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
    "ch09": "KV-cache quantisation and offload",
    "ch10": "Tensor parallelism",
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
    _import_folder(impl)
    module = importlib.import_module(f"{impl}.{chapter}")
    return importlib.reload(module) if reload else module


def _import_folder(impl: str) -> None:
    """Import ``exercises/`` or ``solutions/`` as a package by its path.

    Putting the checkout on ``sys.path`` instead would make its ``kernels/`` folder shadow the
    ``kernels`` package that transformers imports (the course's kernels are ``kvlab.kernels``).
    """
    folder = ROOT / impl
    module = sys.modules.get(impl)
    if module is not None and Path(module.__file__).resolve().parent == folder.resolve():
        return
    for name in [name for name in sys.modules if name == impl or name.startswith(impl + ".")]:
        del sys.modules[name]      # another checkout's (a grader's copy): forget it
    spec = importlib.util.spec_from_file_location(impl, folder / "__init__.py",
                                                  submodule_search_locations=[str(folder)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[impl] = module
    spec.loader.exec_module(module)


# Tasks whose tests launch the learner's Triton kernel, and the kernel: each runs in a process of
# its own, so a kernel that kills the interpreter fails its task and the other tasks still report.
KERNEL_TASKS = {
    "ch02": {"write_kv_kernel": "write_kv_kernel"},
    "ch05": {"online_softmax": "online_softmax_update (in attention_kernel)"},
    "ch06": {"merge_kernel": "merge_splits_kernel"},
    "ch09": {"write_kernel": "write_kv_quantized_kernel"},
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


def grade(chapter: str, impl: str = "exercises", in_this_process: bool = False) -> GradeReport:
    """Run the chapter's graded tests on ``impl`` in a fresh process; returns per-task results.

    The tasks run in child processes, all at once (see :mod:`kvlab.grade_runner`): each kernel
    task in its own, so a kernel that kills its process (an out-of-bounds store, say) fails only
    its own task. ``in_this_process=True`` forks the children from this process instead, when it
    runs Triton's interpreter: the ``kvlab grade`` command does, being a fresh process that has
    imported torch already (never a notebook's kernel).
    """
    _check_chapter(chapter)
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    test_file = ROOT / "tests" / "graded" / f"test_{chapter}.py"
    tasks = _task_order(test_file)
    groups = _task_groups(chapter, tasks)
    # the first group also runs any test that names no task
    selections = [{"KVLAB_GRADE_SKIP_TASKS": ",".join(t for t in tasks if t not in groups[0])}]
    selections += [{"KVLAB_GRADE_TASKS": ",".join(group)} for group in groups[1:]]
    report = GradeReport(chapter, impl)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        plan = {"cwd": str(ROOT), "env": _grading_env(impl), "timeout_s": GRADE_TIMEOUT_S, "groups": []}
        for i, select in enumerate(selections):
            plan["groups"].append({
                "args": [str(test_file), "-m", chapter, f"--impl={impl}", "-q", "-p", "no:cacheprovider",
                         f"--junitxml={tmp / f'report{i}.xml'}", "-o", "junit_family=xunit1"],
                "env": dict(select, KVLAB_GRADE_PROGRESS=str(tmp / f"progress{i}.txt")),
                "output": str(tmp / f"output{i}.txt")})
        if in_this_process and _runs_the_interpreter():
            from kvlab import grade_runner

            codes = grade_runner.run(plan)
        else:
            codes, report.error = _run_grading_process(plan, tmp)
            if report.error:
                return report
        results: dict[str, TaskResult] = {}
        for i in range(len(groups)):
            xml_path, progress, output_path = tmp / f"report{i}.xml", tmp / f"progress{i}.txt", tmp / f"output{i}.txt"
            output = output_path.read_text() if output_path.exists() else ""
            if xml_path.exists():
                found = _parse_junit(xml_path)
            elif _started(progress):
                found = _crash_results(chapter, impl, codes[i], output, progress)
            else:
                found = []
            results.update((result.task, result) for result in found)
            if not xml_path.exists() and not found and not report.error:
                last = output.strip().splitlines()[-1:] or ["pytest failed to start"]
                report.error = last[0] + (f" (the process died: {_signal_name(codes[i])})" if codes[i] < 0 else "")
        report.tasks = sorted(results.values(), key=lambda t: tasks.index(t.task) if t.task in tasks else len(tasks))
        if not report.tasks and not report.error:
            report.error = "no graded tests were collected"
    return report


def _task_groups(chapter: str, tasks: list[str]) -> list[list[str]]:
    """The tasks of each child: every kernel task alone, the others in runs of consecutive tasks,
    as many runs as there are CPU cores left (more children would only share the cores, each
    paying pytest's start-up)."""
    kernels = [task for task in tasks if task in KERNEL_TASKS.get(chapter, {})]
    others = [task for task in tasks if task not in kernels]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    runs = max(1, min(len(others), cores - len(kernels)))
    size = max(1, -(-len(others) // runs))     # ceiling division
    groups = [others[i:i + size] for i in range(0, len(others), size)] + [[task] for task in kernels]
    return groups or [[]]


def _runs_the_interpreter() -> bool:
    """Whether this process runs kvlab's CPU profile, Triton's interpreter: what grading needs."""
    from kvlab import profile

    return profile.PROFILE == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


def _grading_env(impl: str) -> dict[str, str]:
    """The environment of the grading processes: the CPU interpreter, ``impl``, this checkout."""
    env = dict(os.environ, KVLAB_PROFILE="cpu", TRITON_INTERPRET="1", KVLAB_IMPL=impl, KVLAB_GRADE_ROOT=str(ROOT),
               PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")     # no notebook or other plugins: starts ~2 s sooner
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    for variable in ("KVLAB_GRADE_TASKS", "KVLAB_GRADE_SKIP_TASKS", "KVLAB_GRADE_PROGRESS"):
        env.pop(variable, None)
    return env


def _run_grading_process(plan: dict, tmp: Path) -> tuple[dict[int, int], str]:
    """Run ``plan`` in ``python -m kvlab.grade_runner``: the groups' exit codes, and an error
    message if the grading process itself failed."""
    (tmp / "plan.json").write_text(json.dumps(plan))
    with open(tmp / "runner.txt", "w+") as out:
        proc = subprocess.Popen([sys.executable, "-X", "faulthandler", "-m", "kvlab.grade_runner",
                                 str(tmp / "plan.json")], cwd=plan["cwd"], env=plan["env"], stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=GRADE_TIMEOUT_S + 60)     # the runner stops its children at GRADE_TIMEOUT_S
        except subprocess.TimeoutExpired:
            pass
        finally:
            if proc.poll() is None:     # interrupted, or stuck: stop the runner and its children
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        out.seek(0)
        output = out.read()
    status = tmp / "status.json"
    if status.exists():
        return {int(i): code for i, code in json.loads(status.read_text()).items()}, ""
    last = output.strip().splitlines()[-1:] or ["the grading process did not start"]
    return {}, last[0] + (f" (it died: {_signal_name(proc.returncode)})" if proc.returncode < 0 else "")


def _started(progress: Path) -> bool:
    """Whether a child got as far as running a test (so its death was a crash, not a failed start)."""
    return progress.exists() and any(line.startswith("start ") for line in progress.read_text().splitlines())


def _signal_name(returncode: int) -> str:
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


def _crash_results(chapter, impl, returncode, output, progress: Path) -> list[TaskResult]:
    """The tasks of a child that died, from its progress file: how far each got, and for the one
    it was running, the kernel, the test and the line of the graded file."""
    results: dict[str, TaskResult] = {}
    collected: dict[str, int] = {}
    running_task, running = "", ""
    for line in progress.read_text().splitlines():
        state, task, what = (line.split(" ", 2) + ["", ""])[:3]     # task "-": a test of no task
        result = results.setdefault(task, TaskResult(task))
        if state == "collected":
            collected[task] = int(what)
        elif state == "start":
            running_task, running = task, what
        elif state == "passed":
            result.passed += 1
        elif state == "failed":
            result.failed += 1
    how = _signal_name(returncode) if returncode < 0 else f"exit status {returncode}"
    fatal = re.search(r"(Fatal Python error: .*|TIMEOUT: .*)", output)    # may follow pytest's dots on a line
    fatal = fatal.group(1).strip() if fatal else ""
    kernel = KERNEL_TASKS.get(chapter, {}).get(running_task)
    if kernel is not None:
        message = f"CRASH: the grading process died ({fatal or how}) while running your kernel {kernel}.\n{CRASH_HINT}"
    else:
        message = f"CRASH: the grading process died ({fatal or how}) while running the {running_task} tests."
    # faulthandler prints the stack, innermost first: the first frame in the graded file
    where = ""
    for match in re.finditer(r'File "([^"]+)", line (\d+)', output):
        path = Path(match.group(1))
        if path.parent.name == impl and path.name == f"{chapter}.py":
            line = linecache.getline(str(path), int(match.group(2))).strip()
            where = f"{impl}/{path.name}:{match.group(2)}: {line}"
            break
    for task, result in results.items():
        if task == running_task:
            result.crashed = True
            result.add_failure(Failure(running.rpartition("::")[2] or f"the {task} tests", message, where))
        result.not_run = max(0, collected.get(task, 0) - result.passed - result.failed)   # failed: the crash's too
        if result.not_run and task != running_task:
            result.failures.append(Failure(f"the {task} tests", f"NOT RUN: their process died in {running_task} first"))
            result.first_failure = result.failures[-1].message
        result.failed += result.not_run
    return list(results.values())


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
    """The reference answer of one task: its section of ``solutions/chNN.py``, up to any given
    code (``# Given: ...``), and the source of the course's code that the section uses as its answer."""
    tasks = solution_tasks(chapter)
    if task not in tasks:
        raise ValueError(f"task must be one of {chapter}'s tasks {tasks}, got {task!r}")
    text = (ROOT / "solutions" / f"{chapter}.py").read_text()
    section = re.split(r"^# -- task (\w+).*$", text, flags=re.M)
    body = dict(zip(section[1::2], section[2::2]))[task]
    # The answer ends where given code begins (a "# Given: ..." comment at the start of a line): the
    # launchers and use_my_... that follow the last tasks are the scaffold's, not part of an answer.
    answer = re.split(r"^# Given\b", body, maxsplit=1, flags=re.M)[0].strip()
    shown = f"# {chapter}, task {task}: the reference answer (solutions/{chapter}.py)\n" + (answer and answer + "\n")
    # (a course kernel that the given code launches is still the answer: look in the whole section)
    return shown + "".join(_course_source(module, name, local) for module, name, local in _answer_imports(text)
                           if re.search(rf"\b{local}\b", body))


# Where a solution takes its answer from the course's own code (a kernel, a planning function),
# the reveal shows that code too.
_ANSWER_MODULES = ("kvlab.kernels", "kvlab.kernel_plan", "kvlab.paging.prefix_hash")


def _answer_imports(text: str) -> list[tuple[str, str, str]]:
    """``(module, name, local name)`` of each ``from <answer module> import name [as local]``."""
    found = []
    for module, names in re.findall(r"^from ([\w.]+) import ([^\n#]+)", text, flags=re.M):
        if module.startswith(_ANSWER_MODULES):
            for item in names.split(","):
                name, _, local = item.strip().partition(" as ")
                found.append((module, name.strip(), (local or name).strip()))
    return found


def _course_source(module: str, name: str, local: str) -> str:
    import inspect

    obj = getattr(importlib.import_module(module), name)
    source = inspect.getsource(getattr(obj, "fn", obj))      # a @triton.jit kernel keeps its function in .fn
    return f"\n# {local}: the course's own, from {module}\n{source}"


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
