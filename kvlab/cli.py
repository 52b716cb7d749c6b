"""The ``kvlab`` command: ``kvlab check`` and ``kvlab grade ch02``."""
from __future__ import annotations

import argparse
import sys

from kvlab.grading import CHAPTERS, IMPLS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvlab", description="kvlab course tools")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("check", help="check the environment (versions, profile, a Triton kernel, widgets)")
    grade = sub.add_parser("grade", help="grade a chapter's exercises")
    grade.add_argument("chapter", choices=sorted(CHAPTERS))
    grade.add_argument("--impl", choices=IMPLS, default="exercises",
                       help="grade your exercises/ (default) or the reference solutions/")
    args = parser.parse_args(argv)

    if args.command == "check":
        from kvlab.doctor import doctor

        return 0 if doctor() else 1
    from kvlab.grading import grade as run_grade

    # Started as the command (argv from sys.argv), this process has imported torch and nothing of
    # the learner's: it can fork the graded tasks itself instead of starting a grading process.
    report = run_grade(args.chapter, args.impl, in_this_process=argv is None)
    print(report.table())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
