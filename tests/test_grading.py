"""The grading tools: chapter loading, use_solution checkpoints, the kvlab command."""
import shutil

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
