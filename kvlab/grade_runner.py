"""The grading process: imports the test stack once, then runs groups of tasks in forked children.

Importing torch, Triton and pytest takes seconds. The grading process pays it once, and every
child it forks starts with them loaded. Each child runs pytest on its tasks (a kernel task
alone), printing to a file of its own, so a kernel that kills its process (an out-of-bounds
store, say) fails only its task while the other children still report. Your chapter's module
is loaded in the children only.

:func:`kvlab.grading.grade` writes a plan and starts ``python -m kvlab.grade_runner plan.json``;
the ``kvlab grade`` command, a fresh process that has imported torch already, calls :func:`run`
itself. A plan holds ``cwd``, ``env`` (variables for every child), ``timeout_s`` and ``groups``:
for each, pytest's ``args``, the ``env`` that selects its tasks and the ``output`` file.
"""
from __future__ import annotations

import gc
import importlib
import json
import os
import signal
import sys
import time
from pathlib import Path

# Every graded test imports these: load them before forking, so that no child imports them again.
STACK = ("kvlab", "torch", "triton", "triton.language", "numpy", "pytest", "hypothesis")


def run(plan: dict) -> dict[int, int]:
    """Fork one child per group and wait for all, killing those still running after
    ``timeout_s``. Returns each group's exit code, -N for a child killed by signal N."""
    os.chdir(plan["cwd"])
    os.environ.update(plan["env"])
    # Chapters are imported by path (kvlab.grading.load_chapter); with the checkout on sys.path its
    # kernels/ folder would shadow the `kernels` package that transformers imports.
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(plan["cwd"]).resolve()]
    if not hasattr(os, "fork"):
        raise RuntimeError("kvlab's grader forks its test processes: run it on Linux, macOS or WSL2")
    for name in STACK:
        try:
            importlib.import_module(name)
        except ImportError:     # no Triton (macOS, Windows): the chapters that need none still grade
            pass
    # The children share this process's memory until they write to it. Frozen objects are left out
    # of garbage collection, which would otherwise touch (and so copy) every one in every child.
    gc.freeze()
    children = {}
    for i, group in enumerate(plan["groups"]):
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(group["args"], group["env"], group["output"])
        children[pid] = i
    gc.unfreeze()
    codes: dict[int, int] = {}
    deadline = time.monotonic() + plan["timeout_s"]
    while children:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid:
            codes[children.pop(pid)] = os.waitstatus_to_exitcode(status)
        elif time.monotonic() > deadline:
            for pid, i in children.items():
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                codes[i] = -signal.SIGKILL
                with open(plan["groups"][i]["output"], "a") as out:
                    out.write(f"\nTIMEOUT: still running after {plan['timeout_s']} s (an endless loop?)\n")
            children.clear()
        else:
            time.sleep(0.02)
    return codes


def _child(args: list[str], env: dict, output: str) -> None:
    """Run pytest in this forked child with ``env`` added, printing to ``output``; never returns."""
    code = 3
    try:
        fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)        # where faulthandler writes a crash's traceback
        os.close(fd)
        os.environ.update(env)
        import pytest

        code = int(pytest.main(args))
    except BaseException:     # the grader's own failure: the output's last line says what it was
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main(plan_path: str) -> None:
    """Run the plan in ``plan_path``; the exit codes go to ``status.json`` beside it."""
    codes = run(json.loads(Path(plan_path).read_text()))
    (Path(plan_path).parent / "status.json").write_text(json.dumps(codes))


if __name__ == "__main__":
    main(sys.argv[1])
