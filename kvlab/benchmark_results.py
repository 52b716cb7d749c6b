"""The GPU benchmarks' results, found and read: the one place the notebooks get them from.

``benchmarks/bench_*.py --out benchmarks/results`` write JSON files on a GPU machine; the
notebooks plot them. :func:`results_dir` finds that folder wherever the notebook runs and
however kvlab is installed; :func:`load_flash_benchmark` (chapter 5) and
:func:`read_decode_benchmark` (chapter 6) read and check one file each, and return ``None``
when it is not there. The drawing is in :mod:`kvlab.viz.flash` and :mod:`kvlab.viz.decode`.
"""
from __future__ import annotations

import json
import math
import operator
import os
from dataclasses import dataclass
from pathlib import Path

RESULTS_ENV = "KVLAB_BENCHMARK_RESULTS"     # a folder of results, to read instead of the checkout's
FLASH_JSON = "flash_attention.json"          # benchmarks/bench_flash_attention.py
DECODE_JSON = "paged_decode.json"            # benchmarks/bench_paged_decode.py


def results_dir() -> Path | None:
    """The folder of benchmark results, or ``None`` if there is none.

    In order: the folder ``$KVLAB_BENCHMARK_RESULTS`` names; ``benchmarks/results`` in the
    working directory or one above it (a notebook runs in ``notebooks/``, so a non-editable
    install run from a checkout finds the checkout's); ``benchmarks/results`` beside the kvlab
    package (an editable install, from any working directory).
    """
    forced = os.environ.get(RESULTS_ENV, "").strip()
    if forced:
        return Path(forced)
    cwd = Path.cwd().resolve()
    import kvlab

    for base in (cwd, *cwd.parents, Path(kvlab.__file__).resolve().parent.parent):
        candidate = base / "benchmarks" / "results"
        if candidate.is_dir():
            return candidate
    return None


def results_path(name: str) -> Path | None:
    """``name`` (e.g. ``"paged_decode.json"``) in :func:`results_dir`, or ``None`` if it is not there."""
    folder = results_dir()
    path = None if folder is None else folder / name
    return path if path is not None and path.is_file() else None


# -- chapter 5: bench_flash_attention.py ------------------------------------------------------
BENCH_COLUMNS = {"kvlab": "kvlab flash_attention",
                 "kvlab_paged": "kvlab paged_prefill, every key through the table",
                 "kvlab_paged_new": "kvlab paged_prefill, new K/V given (engine)",
                 "sdpa_flash": "SDPA flash (FA2-class)", "sdpa_cudnn": "SDPA cuDNN (FA3-class)",
                 "naive": "naive (scores in memory)"}
PAGED_COLUMNS = ("kvlab_paged", "kvlab_paged_new")     # paged_prefill's two ways of reading keys
_ROW_KEYS = ("batch", "seq_len", "heads", "head_dim")
_EXTEND_KEYS = ("batch", "prefix", "new", "head_dim", "kvlab") + PAGED_COLUMNS


def _check_rows(path, results: dict, name: str, keys) -> None:
    """``results[name]`` must be a list of dicts, each with every key of ``keys``."""
    rows = results[name]
    if not isinstance(rows, list):
        raise ValueError(f"{path}: {name} must be a list of rows, got {type(rows).__name__}")
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ValueError(f"{path}: {name}[{i}] must be a dict, got {type(row).__name__}")
        missing = [key for key in keys if key not in row]
        if missing:
            raise ValueError(f"{path}: {name}[{i}] lacks {', '.join(missing)}")


def load_flash_benchmark(path=None) -> dict | None:
    """The JSON the FlashAttention benchmark writes, checked; ``None`` if there is no such file.

    ``path=None`` reads ``flash_attention.json`` of :func:`results_dir`. ``rows`` need every
    :data:`BENCH_COLUMNS` column; ``extends`` (new tokens after a cached prefix) is optional.
    """
    path = results_path(FLASH_JSON) if path is None else Path(path)
    if path is None or not path.exists():
        return None
    results = json.loads(path.read_text())
    if not isinstance(results, dict) or not isinstance(results.get("rows"), list) or "env" not in results:
        raise ValueError(f"{path}: expected {{'env': {{...}}, 'rows': [...]}}")
    _check_rows(path, results, "rows", _ROW_KEYS + tuple(BENCH_COLUMNS))
    if "extends" in results:
        _check_rows(path, results, "extends", _EXTEND_KEYS)
    return results


def flash_rows(results: dict) -> list[dict]:
    """The ``rows`` of :func:`load_flash_benchmark`'s result (a TypeError for anything else)."""
    if not isinstance(results, dict) or not isinstance(results.get("rows"), list):
        raise TypeError("results must be the dict load_flash_benchmark returns")
    return results["rows"]


def flash_groups(results: dict) -> dict:
    """Rows grouped by (batch, heads, head_dim), each group sorted by sequence length."""
    groups: dict = {}
    for row in flash_rows(results):
        groups.setdefault((row["batch"], row["heads"], row["head_dim"]), []).append(row)
    return {key: sorted(rows, key=lambda r: r["seq_len"]) for key, rows in sorted(groups.items())}


def benchmark_ratios(results: dict) -> list[dict]:
    """Per row: kvlab / SDPA flash, kvlab / cuDNN, cuDNN / SDPA flash (FA3-class over FA2-class),
    and paged / contiguous for both modes of ``paged_prefill`` (every key through the table;
    the new tokens' K/V given)."""
    out = []
    for (batch, heads, head_dim), rows in flash_groups(results).items():
        for r in rows:
            out.append({"batch": batch, "heads": heads, "head_dim": head_dim, "seq_len": r["seq_len"],
                        "kvlab_vs_flash": r["kvlab"] / r["sdpa_flash"],
                        "kvlab_vs_cudnn": r["kvlab"] / r["sdpa_cudnn"],
                        "cudnn_vs_flash": r["sdpa_cudnn"] / r["sdpa_flash"],
                        "paged_vs_contiguous": r["kvlab_paged"] / r["kvlab"],
                        "paged_new_vs_contiguous": r["kvlab_paged_new"] / r["kvlab"]})
    return out


# -- chapter 6: bench_paged_decode.py ---------------------------------------------------------
DECODE_COLUMNS = ("split_TBps", "non_split_TBps", "cudnn_contig_TBps", "flash_contig_TBps", "gather_sdpa_TBps")


def ratio(a: float, b: float) -> float:
    """``a / b``, NaN where either is missing (NaN) or ``b`` is 0."""
    return a / b if b and not math.isnan(a) and not math.isnan(b) else math.nan


@dataclass(frozen=True)
class DecodeBenchmark:
    """``benchmarks/bench_paged_decode.py``'s JSON, with refused measurements as NaN."""

    env: dict
    copy_ceiling_TBps: float
    rows: tuple           # dicts: batch, seq_len, and every DECODE_COLUMNS key as a float (NaN: refused)
    refusals: dict        # (batch, seq_len, key) -> the reason the benchmark recorded

    def speedup(self, row: dict) -> float:
        """Split over non-split bandwidth of one row (same bytes, so the time ratio); NaN if either is missing."""
        return ratio(row["split_TBps"], row["non_split_TBps"])

    def row(self, batch: int, seq_len: int) -> dict | None:
        return next((r for r in self.rows if r["batch"] == batch and r["seq_len"] == seq_len), None)


def decode_benchmark(payload: dict) -> DecodeBenchmark:
    """Check and convert the benchmark's JSON ``payload`` (a dict)."""
    if not isinstance(payload, dict):
        raise TypeError(f"payload must be a dict, got {type(payload).__name__}")
    for key in ("env", "copy_ceiling_Bps", "rows"):
        if key not in payload:
            raise ValueError(f"payload has no {key!r}: not a bench_paged_decode.py result")
    rows, refusals = [], {}
    for i, raw in enumerate(payload["rows"]):
        missing = [k for k in ("batch", "seq_len", *DECODE_COLUMNS) if k not in raw]
        if missing:
            raise ValueError(f"payload rows[{i}] lacks {missing}")
        row = dict(raw)
        for key in DECODE_COLUMNS:
            value = raw[key]
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                row[key] = float(value)
            else:
                row[key] = math.nan
                refusals[(raw["batch"], raw["seq_len"], key)] = str(value)
        rows.append(row)
    rows.sort(key=operator.itemgetter("batch", "seq_len"))
    return DecodeBenchmark(dict(payload["env"]), float(payload["copy_ceiling_Bps"]) / 1e12, tuple(rows), refusals)


def read_decode_benchmark(path=None) -> DecodeBenchmark | None:
    """The benchmark at ``path`` (``None``: ``paged_decode.json`` of :func:`results_dir`), or
    ``None`` when the file does not exist."""
    path = results_path(DECODE_JSON) if path is None else Path(path)
    if path is None or not path.exists():
        return None
    return decode_benchmark(json.loads(path.read_text()))


__all__ = ["RESULTS_ENV", "FLASH_JSON", "DECODE_JSON", "results_dir", "results_path", "BENCH_COLUMNS",
           "PAGED_COLUMNS", "load_flash_benchmark", "flash_rows", "flash_groups", "benchmark_ratios",
           "DECODE_COLUMNS", "ratio", "DecodeBenchmark", "decode_benchmark", "read_decode_benchmark"]
