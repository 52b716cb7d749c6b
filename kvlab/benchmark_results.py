"""The GPU benchmarks' results, found and read: the one place the notebooks get them from.

``benchmarks/bench_*.py --out benchmarks/results`` write JSON files on a GPU machine; the
notebooks plot them. :func:`results_dir` finds that folder wherever the notebook runs and
however kvlab is installed; :func:`load_flash_benchmark` (chapter 5),
:func:`read_decode_benchmark` (chapter 6) and :func:`read_speculative_benchmark` (chapter 7)
read and check one file each, and return ``None`` when it is not there. The drawing is in
:mod:`kvlab.viz.flash`, :mod:`kvlab.viz.decode` and :mod:`kvlab.viz.speculative`.
"""
from __future__ import annotations

import dataclasses
import json
import math
import operator
import os
from dataclasses import dataclass, field
from pathlib import Path

RESULTS_ENV = "KVLAB_BENCHMARK_RESULTS"     # a folder of results, to read instead of the checkout's
FLASH_JSON = "flash_attention.json"          # benchmarks/bench_flash_attention.py
DECODE_JSON = "paged_decode.json"            # benchmarks/bench_paged_decode.py
SPECULATIVE_JSON = "speculative.json"        # benchmarks/bench_speculative.py


def _candidates() -> list[Path]:
    """Where the results may be, in order: ``benchmarks/results`` in the working directory and
    each folder above it, then beside the kvlab package."""
    bases = []
    try:
        cwd = Path.cwd().resolve()
        bases += [cwd, *cwd.parents]
    except OSError:                              # the working directory was removed
        pass
    import kvlab

    bases.append(Path(kvlab.__file__).resolve().parent.parent)
    return [base / "benchmarks" / "results" for base in bases]


def _exists(path: Path, kind: str) -> bool:
    try:
        return path.is_dir() if kind == "dir" else path.is_file()
    except OSError:                              # a folder we may not look into
        return False


def results_dir() -> Path | None:
    """The folder of benchmark results, or ``None`` if there is none.

    The folder ``$KVLAB_BENCHMARK_RESULTS`` names, if set; else the first ``benchmarks/results``
    in the working directory or a folder above it (a notebook runs in ``notebooks/``, so any
    install run from a checkout finds the checkout's), then beside the kvlab package (an
    editable install, from any working directory). A non-editable install run outside a
    checkout finds none: point ``$KVLAB_BENCHMARK_RESULTS`` at the folder.
    """
    forced = os.environ.get(RESULTS_ENV, "").strip()
    if forced:
        return Path(forced)
    return next((folder for folder in _candidates() if _exists(folder, "dir")), None)


def results_path(name: str) -> Path | None:
    """The file ``name`` (e.g. ``"paged_decode.json"``) of the first folder of :func:`results_dir`'s
    order that holds it (only ``$KVLAB_BENCHMARK_RESULTS`` when set), or ``None``."""
    if not isinstance(name, str) or not name or Path(name).name != name:
        raise ValueError(f"name must be a file name such as {FLASH_JSON!r}, got {name!r}")
    forced = os.environ.get(RESULTS_ENV, "").strip()
    folders = [Path(forced)] if forced else _candidates()
    return next((folder / name for folder in folders if _exists(folder / name, "file")), None)


def load_results(name: str, path=None) -> tuple[object, Path] | None:
    """``(parsed JSON, its path)`` of ``path``, or of ``name`` in :func:`results_dir` when
    ``path`` is None; ``None`` when there is no such file."""
    path = results_path(name) if path is None else Path(path)
    if path is None or not path.exists():
        return None
    return json.loads(path.read_text()), path


# -- chapter 5: bench_flash_attention.py ------------------------------------------------------
BENCH_COLUMNS = {"kvlab": "kvlab flash_attention",
                 "kvlab_paged": "kvlab paged_prefill, every key through the table",
                 "kvlab_paged_new": "kvlab paged_prefill, new K/V given",
                 "sdpa_flash": "SDPA flash (FA-2)", "sdpa_cudnn": "SDPA cuDNN",
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
    loaded = load_results(FLASH_JSON, path)
    if loaded is None:
        return None
    results, path = loaded
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
    """Per row: kvlab / SDPA flash, kvlab / cuDNN, cuDNN / SDPA flash (a Hopper-tuned kernel over FA-2),
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
    loaded = load_results(DECODE_JSON, path)
    return None if loaded is None else decode_benchmark(loaded[0])


# -- chapter 7: bench_speculative.py ----------------------------------------------------------
SPECULATIVE_SECTIONS = ("verify_cost", "verify_ratio_k5_b1", "tiny_pair", "end_to_end", "batch_speedup")


def _floats(values, name: str, length: int | None = None) -> tuple:
    if not isinstance(values, (list, tuple)) or any(isinstance(v, bool) or not isinstance(v, (int, float))
                                                    for v in values):
        raise ValueError(f"{name} must be a list of numbers")
    if length is not None and len(values) != length:
        raise ValueError(f"{name} has {len(values)} values, expected {length}")
    return tuple(float(v) for v in values)


def _verify_cost(raw: dict) -> dict:
    batches = tuple(int(b) for b in raw["batches"])
    query_tokens = tuple(int(q) for q in raw["query_tokens"])
    out = {key: raw[key] for key in ("model", "context", "graphs") if key in raw}
    out.update(batches=batches, query_tokens=query_tokens)
    for key in ("step_ms", "step_ms_prefill_kernel"):
        if key in raw:
            out[key] = {b: _floats(raw[key][str(b)], f"verify_cost.{key}[{b}]", len(query_tokens)) for b in batches}
    if "step_ms" not in out:
        raise KeyError("step_ms")
    return out


def _tiny_pair(raw: dict) -> dict:
    ks = tuple(int(k) for k in raw["k"])
    out = dict(raw, alpha_k1=float(raw["alpha_k1"]), k=ks)
    for key in ("measured_tokens_per_step", "predicted_tokens_per_step"):
        out[key] = _floats(raw[key], f"tiny_pair.{key}", len(ks))
    out["acceptance_by_position"] = {int(k): _floats(v, f"tiny_pair.acceptance_by_position[{k}]")
                                     for k, v in raw.get("acceptance_by_position", {}).items()}
    return out


def _end_to_end(raw: dict) -> dict:
    out = dict(raw, baseline_tok_s=float(raw["baseline_tok_s"]))
    methods = [m for m in ("ngram", "draft_model") if isinstance(raw.get(m), dict)]
    if not methods:
        raise KeyError("ngram or draft_model")
    for m in methods:
        out[m] = dict(raw[m], speedup=float(raw[m]["speedup"]), k=int(raw[m]["k"]))
    return out


def _batch_speedup(raw: dict) -> dict:
    batch = tuple(int(b) for b in raw["batch"])
    out = dict(raw, batch=batch)
    methods = [m for m in ("ngram", "draft_model") if m in raw]
    if not methods:
        raise KeyError("ngram or draft_model")
    for m in methods:
        out[m] = _floats(raw[m], f"batch_speedup.{m}", len(batch))
    return out


@dataclass(frozen=True)
class SpeculativeBenchmark:
    """``benchmarks/bench_speculative.py``'s JSON. Each section is checked on its own: one that is
    missing or malformed is ``None``, and :meth:`why_missing` says why, so the others still plot.

    ``verify_cost``: ``batches``, ``query_tokens`` and ``step_ms`` {batch: ms per q} (ints as
    keys); ``tiny_pair``: ``alpha_k1``, ``k``, ``measured_tokens_per_step``,
    ``predicted_tokens_per_step``, ``acceptance_by_position`` {k: P(i-th draft kept)};
    ``end_to_end``: ``baseline_tok_s`` and a dict per method (``k``, ``tok_s``, ``speedup``, ...);
    ``batch_speedup``: ``batch`` and a speedup per batch for each method.
    """

    path: str
    device: str
    date: str
    verify_cost: dict | None = None
    verify_ratio_k5_b1: float | None = None
    tiny_pair: dict | None = None
    end_to_end: dict | None = None
    batch_speedup: dict | None = None
    problems: dict = field(default_factory=dict)     # section -> why it is None

    def why_missing(self, section: str) -> str | None:
        """``None`` if ``section`` was read, else a sentence saying why it is not there."""
        if section not in SPECULATIVE_SECTIONS:
            raise ValueError(f"section must be one of {SPECULATIVE_SECTIONS}, got {section!r}")
        if getattr(self, section) is not None:
            return None
        return f"{self.path} has no usable {section!r} ({self.problems.get(section, 'missing')})"

    def verify_ratio(self, batch: int, query_tokens: int) -> float:
        """Step time with ``query_tokens`` per sequence over the 1-token step, at ``batch``; NaN if not measured."""
        cost = self.verify_cost
        if cost is None or batch not in cost["step_ms"] or not {1, query_tokens} <= set(cost["query_tokens"]):
            return math.nan
        row = cost["step_ms"][batch]
        return ratio(row[cost["query_tokens"].index(query_tokens)], row[cost["query_tokens"].index(1)])


def speculative_benchmark(payload: dict, path: str = "speculative.json") -> SpeculativeBenchmark:
    """Check and convert the benchmark's JSON ``payload`` (a dict), section by section."""
    if not isinstance(payload, dict):
        raise TypeError(f"payload must be a dict, got {type(payload).__name__}")
    readers = {"verify_cost": _verify_cost, "tiny_pair": _tiny_pair, "end_to_end": _end_to_end,
               "batch_speedup": _batch_speedup, "verify_ratio_k5_b1": float}
    sections, problems = {}, {}
    for name, reader in readers.items():
        if name not in payload:
            problems[name] = "not in the file"
            continue
        try:
            sections[name] = reader(payload[name])
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            problems[name] = f"malformed: {type(e).__name__}: {e}"
    bench = SpeculativeBenchmark(str(path), str(payload.get("device", "?")), str(payload.get("date", "?")),
                                 problems=problems, **sections)
    if bench.verify_ratio_k5_b1 is None and not math.isnan(bench.verify_ratio(1, 6)):   # derivable
        problems.pop("verify_ratio_k5_b1", None)
        bench = dataclasses.replace(bench, verify_ratio_k5_b1=bench.verify_ratio(1, 6))
    return bench


def read_speculative_benchmark(path=None) -> SpeculativeBenchmark | None:
    """The benchmark at ``path`` (``None``: ``speculative.json`` of :func:`results_dir`), or
    ``None`` when the file does not exist."""
    loaded = load_results(SPECULATIVE_JSON, path)
    return None if loaded is None else speculative_benchmark(loaded[0], loaded[1].name)


__all__ = ["RESULTS_ENV", "FLASH_JSON", "DECODE_JSON", "results_dir", "results_path", "load_results", "BENCH_COLUMNS",
           "PAGED_COLUMNS", "load_flash_benchmark", "flash_rows", "flash_groups", "benchmark_ratios",
           "DECODE_COLUMNS", "ratio", "DecodeBenchmark", "decode_benchmark", "read_decode_benchmark",
           "SPECULATIVE_JSON", "SPECULATIVE_SECTIONS", "SpeculativeBenchmark", "speculative_benchmark",
           "read_speculative_benchmark"]


# -- chapter 8: bench_serving.py --------------------------------------------------------------
SERVING_JSON = "serving.json"                # benchmarks/bench_serving.py
SERVING_ROW_KEYS = ("name", "ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "output_throughput", "total_throughput")


@dataclass(frozen=True)
class ServingBenchmark:
    """``benchmarks/bench_serving.py``'s JSON, read leniently: what is missing or malformed is
    left out, and :meth:`why_missing` says why, so the rest still plots.

    ``rows``: one dict per configuration measured, with every :data:`SERVING_ROW_KEYS` key
    (latencies in seconds, NaN where the run had none), and where present ``settings``,
    ``ttft_s`` (every request's TTFT), ``itl_quantiles_s`` (percentiles 0..100 of the pooled
    ITLs), ``simulated`` (the replay of the same trace with ``cost_model``). ``trace``: requests,
    rate_req_s, seed and mix of the replayed trace. ``cost_model``: StepCostModel coefficients
    fitted on the continuous run.
    """

    path: str
    env: dict
    model: str
    engine: dict
    rows: tuple
    trace: dict | None = None
    cost_model: dict | None = None
    long_prefill_tokens: int | None = None
    problems: dict = field(default_factory=dict)     # "trace", "cost_model", "rows" or a row's name -> why

    def row(self, name: str) -> dict | None:
        return next((r for r in self.rows if r["name"] == name), None)

    def why_missing(self, what: str) -> str | None:
        """``None`` if ``what`` ("trace", "cost_model", "rows" or a configuration's name) was
        read, else a sentence saying why it is not there."""
        if what == "rows":
            present = bool(self.rows)
        elif what in ("trace", "cost_model"):
            present = getattr(self, what) is not None
        else:
            present = self.row(what) is not None
        if present:
            return None
        return f"{self.path} has no usable {what!r} ({self.problems.get(what, 'not in the file')})"


def _number(value) -> float:
    if value is None:
        return math.nan
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"expected a number, got {value!r}")
    return float(value)


def _serving_row(raw) -> dict:
    if not isinstance(raw, dict):
        raise ValueError(f"a row must be a dict, got {type(raw).__name__}")
    missing = [k for k in SERVING_ROW_KEYS if k not in raw]
    if missing:
        raise KeyError(", ".join(missing))
    row = dict(raw, name=str(raw["name"]))
    for key in SERVING_ROW_KEYS[1:]:
        row[key] = _number(raw[key])
    if "ttft_s" in raw:
        row["ttft_s"] = tuple(_number(v) for v in raw["ttft_s"])
    if "itl_quantiles_s" in raw:
        row["itl_quantiles_s"] = tuple(_number(v) for v in raw["itl_quantiles_s"])
        if len(row["itl_quantiles_s"]) != 101:
            raise ValueError(f"itl_quantiles_s has {len(row['itl_quantiles_s'])} values, expected 101")
    return row


def serving_benchmark(payload: dict, path: str = SERVING_JSON) -> ServingBenchmark:
    """Check and convert the benchmark's JSON ``payload`` (a dict), part by part."""
    if not isinstance(payload, dict):
        raise TypeError(f"payload must be a dict, got {type(payload).__name__}")
    problems, rows = {}, []
    raw_rows = payload.get("rows")
    if not isinstance(raw_rows, list):
        problems["rows"] = "not in the file" if raw_rows is None else "not a list"
        raw_rows = []
    for i, raw in enumerate(raw_rows):
        name = raw.get("name", f"rows[{i}]") if isinstance(raw, dict) else f"rows[{i}]"
        if isinstance(raw, dict) and "skipped" in raw:
            problems[name] = f"skipped by the benchmark: {raw['skipped']}"
            continue
        try:
            rows.append(_serving_row(raw))
        except (KeyError, TypeError, ValueError) as e:
            problems[name] = f"malformed: {type(e).__name__}: {e}"
    if raw_rows and not rows:
        problems.setdefault("rows", "no row could be read")
    trace = payload.get("trace")
    if trace is not None and not (isinstance(trace, dict) and {"requests", "rate_req_s", "seed", "mix"} <= set(trace)):
        problems["trace"], trace = "malformed: needs requests, rate_req_s, seed and mix", None
    cost = payload.get("cost_model")
    if cost is not None:
        try:
            cost = {k: _number(v) for k, v in cost.items()}
        except (AttributeError, ValueError) as e:
            problems["cost_model"], cost = f"malformed: {e}", None
    long_prefill = payload.get("long_prefill_tokens")
    engine = payload.get("engine")
    return ServingBenchmark(str(path), dict(payload.get("env") or {}), str(payload.get("model", "?")),
                            dict(engine) if isinstance(engine, dict) else {}, tuple(rows), trace, cost,
                            int(long_prefill) if isinstance(long_prefill, int) else None, problems)


def read_serving_benchmark(path=None) -> ServingBenchmark | None:
    """The benchmark at ``path`` (``None``: ``serving.json`` of :func:`results_dir`), or
    ``None`` when the file does not exist."""
    loaded = load_results(SERVING_JSON, path)
    return None if loaded is None else serving_benchmark(loaded[0], loaded[1].name)


__all__ += ["SERVING_JSON", "SERVING_ROW_KEYS", "ServingBenchmark", "serving_benchmark", "read_serving_benchmark"]
