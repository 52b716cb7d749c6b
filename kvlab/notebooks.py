"""Execute the course notebooks and strip widget state: ``python -m kvlab.notebooks run|strip FILES``.

Notebooks are committed executed (with the outputs of a GPU run) and without the saved
state of their widgets, which is large and meaningless outside a live kernel.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path


def strip(path: Path) -> None:
    import nbformat

    nb = nbformat.read(path, as_version=4)
    nb.metadata.pop("widgets", None)
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
    nbformat.write(nb, path)


def run(path: Path, timeout: int = 1200) -> float:
    """Execute ``path`` in place from its own folder; returns the seconds it took."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    start = time.perf_counter()
    NotebookClient(nb, timeout=timeout, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    nbformat.write(nb, path)
    strip(path)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kvlab.notebooks")
    parser.add_argument("action", choices=["run", "strip"])
    parser.add_argument("paths", nargs="+", type=Path)
    args = parser.parse_args(argv)
    for path in args.paths:
        if args.action == "run":
            print(f"{path}: executed in {run(path):.1f} s", flush=True)
        else:
            strip(path)


if __name__ == "__main__":
    main()
