"""Plant known bugs in a copy of the course and check that the test suite catches each one.

    python tests/planted_bugs.py            # prints one line per bug; exits 1 if one survives

Each bug is a one-line change to the source. The copy is made in a temporary folder, the
change applied there, and the test files that should notice are run against it.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

BUGS = [
    # (name, file, original line, planted line, test files that must fail)
    ("copy-on-write copies from a copy not yet made", "kvlab/paging/block_pool.py",
     "source = next((src for src, dst in self.pending_copies if dst == shared), shared)",
     "source = shared",
     ["tests/test_engine_hardening.py", "tests/test_block_pool.py"]),
    ("the context-length stop is off by one", "kvlab/engine/sequence.py",
     "elif max_model_len is not None and self.num_tokens >= max_model_len:",
     "elif max_model_len is not None and self.num_tokens > max_model_len:",
     ["tests/test_engine_hardening.py", "tests/test_engine.py"]),
    ("a block is cached before its K/V is computed", "kvlab/engine/scheduler.py",
     "self.pool.allocate(seq.seq_id, end, seq.token_ids[:end], salt=seq.cache_salt, cache=False)",
     "self.pool.allocate(seq.seq_id, end, seq.token_ids[:end], salt=seq.cache_salt, cache=True)",
     ["tests/test_engine_hardening.py"]),
    ("the tenant's salt does not reach the pool", "kvlab/engine/scheduler.py",
     "self.pool.allocate(seq.seq_id, end, seq.token_ids[:end], salt=seq.cache_salt, cache=False)",
     "self.pool.allocate(seq.seq_id, end, seq.token_ids[:end], salt=None, cache=False)",
     ["tests/test_engine_hardening.py"]),
    ("drafts are booked past the cache's last slot", "kvlab/engine/spec_decode.py",
     "limit = min(max_model_len, pool.num_blocks * pool.block_size)",
     "limit = max_model_len",
     ["tests/test_spec_decode.py"]),
    ("a prompt that forks its samples takes drafts", "kvlab/engine/spec_decode.py",
     "room = [0 if s.forks else max(0, min(k, limit - s.seq.num_tokens)) for s in items]",
     "room = [max(0, min(k, limit - s.seq.num_tokens)) for s in items]",
     ["tests/test_spec_decode.py"]),
    ("tokens after a stop string in the same step are kept", "kvlab/engine/llm.py",
     "            if emitted > 1:",
     "            if False:",
     ["tests/test_spec_decode.py"]),
    ("an aborted swapped-out sequence keeps its host blocks", "kvlab/engine/scheduler.py",
     "            self.swapped.remove(seq)\n            self._host_to_free += seq.host_blocks",
     "            self.swapped.remove(seq)",
     ["tests/test_engine_hardening.py"]),
]


def caught(name: str, file: str, original: str, planted: str, tests: list[str]) -> bool:
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "kvlab-course"
        shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns(".venv", ".git", "notebooks", "__pycache__",
                                                                  ".hypothesis", "benchmarks"))
        source = copy / file
        text = source.read_text()
        if original not in text:
            raise SystemExit(f"{name}: the line to change is no longer in {file}")
        source.write_text(text.replace(original, planted))
        # the copy's kernels are imported as kvlab.kernels, as the editable install maps them
        (copy / "kvlab" / "kernels").symlink_to(copy / "kernels", target_is_directory=True)
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests],
                             cwd=copy, capture_output=True, text=True, env={"PYTHONPATH": str(copy),
                                                                           "KVLAB_PROFILE": "cpu",
                                                                           "PATH": "/usr/bin:/bin"})
        return run.returncode != 0


def main() -> int:
    # the control: the same copy and tests with nothing planted must pass
    name, file, original, _, tests = BUGS[0]
    if caught("control", file, original, original, sorted({t for bug in BUGS for t in bug[4]})):
        raise SystemExit("the tests fail on an unchanged copy: fix that first")
    survivors = 0
    for bug in BUGS:
        ok = caught(*bug)
        survivors += not ok
        print(f"{'caught  ' if ok else 'SURVIVED'}  {bug[0]}", flush=True)
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
