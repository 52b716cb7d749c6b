import os
import sys
from pathlib import Path

import kvlab  # noqa: F401  (picks the profile before anything imports triton)

# `python -m pytest` puts the checkout on sys.path, where its kernels/ folder would shadow the
# `kernels` package that transformers imports; the course's kernels are kvlab.kernels.
ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT]


def pytest_addoption(parser):
    parser.addoption("--impl", default=os.environ.get("KVLAB_IMPL", "solutions"),
                     choices=["solutions", "exercises"],
                     help="which implementation the graded tests run on (default: solutions)")
