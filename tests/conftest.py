import os

import kvlab  # noqa: F401  (picks the profile before anything imports triton)


def pytest_addoption(parser):
    parser.addoption("--impl", default=os.environ.get("KVLAB_IMPL", "solutions"),
                     choices=["solutions", "exercises"],
                     help="which implementation the graded tests run on (default: solutions)")
