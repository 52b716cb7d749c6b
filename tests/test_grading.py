"""The grading tools: chapter loading, use_solution checkpoints, the kvlab command."""
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import kvlab
from kvlab import grading
from kvlab.cli import main


def test_load_chapter_picks_the_implementation():
    assert grading.load_chapter("ch02", "solutions").__name__ == "solutions.ch02"
    assert grading.load_chapter("ch02", "exercises").__name__ == "exercises.ch02"


@pytest.mark.parametrize("chapter,impl,error", [("ch99", "exercises", ValueError), ("ch02", "mine", ValueError)])
def test_bad_chapter_or_impl(chapter, impl, error):
    with pytest.raises(error, match="chapter|impl"):
        grading.grade(chapter, impl)


def test_use_solution_keeps_the_learners_version(tmp_path, monkeypatch):
    for folder in ("exercises", "solutions"):
        (tmp_path / folder).mkdir()
    (tmp_path / "exercises" / "ch02.py").write_text("# mine\n")
    shutil.copy(grading.ROOT / "solutions" / "ch02.py", tmp_path / "solutions" / "ch02.py")
    monkeypatch.setattr(grading, "ROOT", tmp_path)
    first = grading.use_solution("ch02")
    assert first.name == "ch02_mine.py" and first.read_text() == "# mine\n"
    assert (tmp_path / "exercises" / "ch02.py").read_text() == (tmp_path / "solutions" / "ch02.py").read_text()
    second = grading.use_solution("ch02")
    assert second.name == "ch02_mine2.py" and first.read_text() == "# mine\n"


def test_cli_grade_exit_codes(capsys):
    assert main(["grade", "ch02", "--impl", "solutions"]) == 0
    assert "3/3 tasks pass" in capsys.readouterr().out
    assert main(["grade", "ch02"]) == 1          # the stubs fail
    assert "NotImplementedError" in capsys.readouterr().out


def test_doctor_smoke_kernel_matches_torch():
    from kvlab.doctor import triton_smoke_test

    ok, detail = triton_smoke_test()
    assert ok, detail


def test_profile_resolve():
    assert kvlab.profile.resolve(None) == kvlab.profile.PROFILE
    assert kvlab.profile.resolve("cpu") == "cpu"
    with pytest.raises(ValueError, match="profile must be one of"):
        kvlab.profile.resolve("tpu")
    assert kvlab.profile.pick(cpu=1, gpu=2, profile="cpu") == 1


# -- what the grader tells a learner -----------------------------------------------------------
def course_copy(tmp_path, monkeypatch):
    """A copy of the course the grader runs on, so a test can plant a learner's file."""
    for folder in ("exercises", "solutions"):
        shutil.copytree(grading.ROOT / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "tests").mkdir()
    for name in ("conftest.py", "helpers.py"):
        shutil.copy(grading.ROOT / "tests" / name, tmp_path / "tests")
    shutil.copytree(grading.ROOT / "tests" / "graded", tmp_path / "tests" / "graded",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(grading.ROOT / "pyproject.toml", tmp_path)
    monkeypatch.setattr(grading, "ROOT", tmp_path)
    return tmp_path


def plant(root, chapter, old, new):
    path = root / "exercises" / f"{chapter}.py"
    text = path.read_text()
    assert old in text, old
    path.write_text(text.replace(old, new))


def test_a_wrong_answer_shows_expected_got_and_the_learners_line(tmp_path, monkeypatch):
    root = course_copy(tmp_path, monkeypatch)
    off_by_one = ("    return [block_table[pos // block_size] * block_size + pos % block_size\n"
                  "            for pos in range(start + 1, start + num_tokens + 1)]\n")
    stub = '    raise NotImplementedError("slot_mapping: slot = physical block * block_size + offset in block")\n'
    plant(root, "ch02", stub, off_by_one)
    report = grading.grade("ch02")
    task = next(t for t in report.tasks if t.task == "slot_mapping")
    assert not task.ok
    table = report.table()
    assert "test_slot_mapping_worked_example" in table
    assert "got:      [15, 28, 29, 30, 31]" in table and "expected: [14, 15, 28, 29, 30]" in table, table
    line = next(i for i, text in enumerate((root / "exercises" / "ch02.py").read_text().splitlines(), 1)
                if "for pos in range(start + 1" in text)
    # the random test runs off the end of the table: the traceback goes through the learner's line
    assert f"exercises/ch02.py:{line - 1}: return [block_table[pos // block_size]" in table, table


KERNEL_BODY = '''    raise NotImplementedError("write_kv_kernel: load the slot, load the K and V rows, store them "
                              "at slot * ROW (masked; skip slot -1: mask = cols < tl.where(slot >= 0, ROW, 0))")'''


def kernel_body(store_offset):
    return f"""    token = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    slot = tl.load(slot_mapping_ptr + token)
    mask = cols < ROW
    k = tl.load(key_ptr + token * key_token_stride + cols, mask=mask)
    v = tl.load(value_ptr + token * value_token_stride + cols, mask=mask)
    tl.store(k_cache_ptr + {store_offset} + cols, k, mask=mask)
    tl.store(v_cache_ptr + {store_offset} + cols, v, mask=mask)"""


def test_a_crashing_kernel_fails_its_task_only(tmp_path, monkeypatch):
    root = course_copy(tmp_path, monkeypatch)
    shutil.copy(root / "solutions" / "ch02.py", root / "exercises" / "ch02.py")
    plant(root, "ch02", "write_kv = write_kv_with(write_kv_kernel)\n",
          "def write_kv(key, value, k_cache, v_cache, slot_mapping):\n    import os; os.abort()\n")
    report = grading.grade("ch02")
    tasks = {t.task: t for t in report.tasks}
    assert not report.error and set(tasks) == {"block_pool", "slot_mapping", "write_kv_kernel"}, report.table()
    assert tasks["block_pool"].ok and tasks["slot_mapping"].ok, report.table()
    crashed = tasks["write_kv_kernel"]
    assert crashed.crashed and not crashed.ok and crashed.failed == 4      # every test of the task
    table = report.table()
    assert "write_kv_kernel" in crashed.first_failure and "Aborted" in crashed.first_failure, table
    assert "out-of-bounds load or store" in table and "os.abort()" in table, table


def test_the_kvlab_command_isolates_a_crash_too(tmp_path, monkeypatch):
    """``kvlab grade`` forks the children from its own process: a crash still fails only its own
    task (here one without a kernel), and the tasks of the other children still report."""
    root = course_copy(tmp_path, monkeypatch)
    shutil.copy(root / "solutions" / "ch02.py", root / "exercises" / "ch02.py")
    plant(root, "ch02", "def slot_mapping(", "def slot_mapping(*args):\n    import os; os.abort()\n\n\ndef unused(")
    env = dict(os.environ, KVLAB_GRADE_ROOT=str(root))
    done = subprocess.run([sys.executable, "-m", "kvlab.cli", "grade", "ch02"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    table = done.stdout
    assert done.returncode == 1, table + done.stderr
    assert "PASS  block_pool" in table and "PASS  write_kv_kernel" in table, table
    assert "FAIL  slot_mapping" in table and "CRASHED" in table and "running the slot_mapping tests" in table, table
    assert "2/3 tasks pass" in table


@pytest.mark.parametrize("cores, ch02, ch07", [
    (1, [["block_pool", "slot_mapping"], ["write_kv_kernel"]], [["a", "b", "c", "d", "e"]]),
    (2, [["block_pool", "slot_mapping"], ["write_kv_kernel"]], [["a", "b", "c"], ["d", "e"]]),
    (8, [["block_pool"], ["slot_mapping"], ["write_kv_kernel"]], [["a"], ["b"], ["c"], ["d"], ["e"]]),
])
def test_each_kernel_task_gets_a_child_and_the_others_share_the_cores_left(monkeypatch, cores, ch02, ch07):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    assert grading._task_groups("ch02", ["block_pool", "slot_mapping", "write_kv_kernel"]) == ch02
    assert grading._task_groups("ch07", ["a", "b", "c", "d", "e"]) == ch07      # no kernel task


def test_a_crash_reports_every_task_of_its_child(tmp_path):
    """From the progress file: the tasks before the crash keep their results, the running one is
    the crash, and a task that never started is marked as not run."""
    progress = tmp_path / "progress.txt"
    progress.write_text("collected block_pool 2\ncollected slot_mapping 3\ncollected write_kv_kernel 2\n"
                        "start block_pool t.py::test_a\npassed block_pool t.py::test_a\n"
                        "start block_pool t.py::test_b\nfailed block_pool t.py::test_b\n"
                        "start slot_mapping t.py::test_c[x y]\n")
    output = '..F\nFatal Python error: Segmentation fault\n  File "/x/exercises/ch02.py", line 3 in f\n'
    tasks = {t.task: t for t in grading._crash_results("ch02", "exercises", -11, output, progress)}
    assert (tasks["block_pool"].passed, tasks["block_pool"].failed, tasks["block_pool"].crashed) == (1, 1, False)
    crashed = tasks["slot_mapping"]
    assert crashed.crashed and (crashed.passed, crashed.failed, crashed.not_run) == (0, 3, 2)
    assert crashed.failures[0].test == "test_c[x y]" and "Segmentation fault" in crashed.first_failure
    assert "running the slot_mapping tests" in crashed.first_failure
    skipped = tasks["write_kv_kernel"]
    assert not skipped.ok and skipped.failed == skipped.not_run == 2 and "NOT RUN" in skipped.first_failure


def test_the_grading_process_stops_a_task_past_the_timeout(tmp_path):
    """A child still running at the deadline is killed and its output says so; the others report."""
    (tmp_path / "test_loop.py").write_text("def test_loop():\n    while True:\n        pass\n")
    (tmp_path / "test_ok.py").write_text("def test_ok():\n    assert True\n")
    plan = {"cwd": str(tmp_path), "env": {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}, "timeout_s": 3, "groups": [
        {"args": [str(tmp_path / name), "-q", "-p", "no:cacheprovider"], "env": {},
         "output": str(tmp_path / f"{name}.txt")} for name in ("test_loop.py", "test_ok.py")]}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    subprocess.run([sys.executable, "-m", "kvlab.grade_runner", str(tmp_path / "plan.json")], check=True, timeout=300)
    assert json.loads((tmp_path / "status.json").read_text()) == {"0": -9, "1": 0}
    assert "TIMEOUT" in (tmp_path / "test_loop.py.txt").read_text()
    assert "1 passed" in (tmp_path / "test_ok.py.txt").read_text()


def test_a_store_past_the_slot_is_caught(tmp_path, monkeypatch):
    root = course_copy(tmp_path, monkeypatch)
    plant(root, "ch02", KERNEL_BODY, kernel_body("slot * ROW"))        # slot -1 is not skipped
    report = grading.grade("ch02")
    task = next(t for t in report.tasks if t.task == "write_kv_kernel")
    assert not task.ok and task.failed == 4
    assert "wrote before the start of `k_cache`" in task.first_failure, report.table()


def test_the_canary_catches_a_store_past_the_end(tmp_path, monkeypatch):
    root = course_copy(tmp_path, monkeypatch)
    plant(root, "ch02", KERNEL_BODY, kernel_body("tl.where(slot >= 0, slot, 23) * ROW + ROW"))
    report = grading.grade("ch02")
    task = next(t for t in report.tasks if t.task == "write_kv_kernel")
    assert "wrote past the end of `k_cache`" in task.first_failure, report.table()
    assert "check the store mask" in task.first_failure


def test_show_solution_prints_one_tasks_section_and_names_bad_tasks(capsys):
    from kvlab.grading import solution_tasks

    for chapter in ("ch01", "ch02", "ch03", "ch04", "ch05", "ch06", "ch07", "ch08", "ch09", "ch10"):
        tasks = solution_tasks(chapter)
        assert tasks, chapter
        graded = (Path(__file__).parent / "graded" / f"test_{chapter}.py").read_text()
        for task in tasks:  # every revealable task is a graded task, by the same name
            assert f'task("{task}")' in graded, (chapter, task)
    kvlab.show_solution("ch02", "slot_mapping")
    shown = capsys.readouterr().out
    assert "def slot_mapping" in shown and "write_kv_kernel" not in shown
    with pytest.raises(ValueError, match="ch02's tasks"):
        kvlab.show_solution("ch02", "no_such_task")
    # a task answered by the course's own kernel reveals that kernel's source too
    kvlab.show_solution("ch02", "write_kv_kernel")
    assert "def write_kv_kernel(" in capsys.readouterr().out
    # the last task's answer stops where the given code after it begins
    kvlab.show_solution("ch09", "crossover")
    shown = capsys.readouterr().out
    assert "def crossover_tokens" in shown and "use_my_quantization" not in shown


def test_loading_a_chapter_leaves_transformers_its_kernels_package():
    """The checkout's kernels/ folder is kvlab.kernels: loading a chapter must not put the checkout
    on sys.path, where that folder would shadow the `kernels` package transformers imports."""
    grading.load_chapter("ch02", "exercises")
    grading.load_chapter("ch02", "solutions")
    assert str(grading.ROOT) not in sys.path and "" not in sys.path
    found = importlib.util.find_spec("kernels")
    assert found is None or grading.ROOT / "kernels" not in Path(found.origin or "").parents
