"""``tests/planted_bugs.py`` (run by hand: it copies the course once per bug) names each bug by
the line it changes. Here, in CI, each of those lines must still be in its file, once."""
from planted_bugs import BUGS, ROOT


def test_every_planted_bug_still_finds_its_line():
    for name, file, original, _, _ in BUGS:
        assert (ROOT / file).read_text().count(original) == 1, f"{name}: its line is not once in {file}"
