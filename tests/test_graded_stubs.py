"""The graded suite can fail: against the exercise stubs every task fails with NotImplementedError."""
import pytest

from kvlab.grading import CHAPTERS, grade


@pytest.mark.parametrize("chapter", sorted(CHAPTERS))
def test_every_task_fails_on_the_stubs(chapter):
    report = grade(chapter, impl="exercises")
    assert not report.error, report.error
    assert report.tasks, f"no graded tests collected for {chapter}"
    for task in report.tasks:
        assert task.passed == 0 and task.failed > 0, f"{chapter}/{task.task} passes on the stubs"
        assert "NotImplementedError" in task.first_failure, f"{chapter}/{task.task}: {task.first_failure}"


def test_solutions_pass_through_the_grader():
    report = grade("ch02", impl="solutions")
    assert report.ok, report.table()
