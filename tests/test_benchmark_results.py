"""kvlab.benchmark_results: the benchmarks' JSON found from any folder, and read."""
import json
import math
from pathlib import Path

import pytest

import kvlab
from kvlab import benchmark_results as br

FLASH = {"env": {"gpu": "test"},
         "rows": [dict(batch=1, seq_len=1024, heads=8, head_dim=128, kvlab=100.0, kvlab_paged=80.0,
                       kvlab_paged_new=90.0, sdpa_flash=125.0, sdpa_cudnn=200.0, naive=10.0)]}
DECODE = {"env": {"gpu": "test", "sms": 132}, "copy_ceiling_Bps": 4.0e12,
          "rows": [dict(batch=1, seq_len=32768, split_TBps=3.0, non_split_TBps=0.3, cudnn_contig_TBps=2.0,
                        flash_contig_TBps=1.0, gather_sdpa_TBps="refused: out of memory")]}


def results_tree(root: Path) -> Path:
    folder = root / "benchmarks" / "results"
    folder.mkdir(parents=True)
    (folder / br.FLASH_JSON).write_text(json.dumps(FLASH))
    (folder / br.DECODE_JSON).write_text(json.dumps(DECODE))
    return folder


def test_found_from_the_notebooks_folder(tmp_path, monkeypatch):
    monkeypatch.delenv(br.RESULTS_ENV, raising=False)
    folder = results_tree(tmp_path)
    (tmp_path / "notebooks").mkdir()
    monkeypatch.chdir(tmp_path / "notebooks")
    assert br.results_dir() == folder.resolve()
    assert br.load_flash_benchmark()["rows"][0]["kvlab"] == 100.0
    bench = br.read_decode_benchmark()
    assert bench.copy_ceiling_TBps == 4.0 and bench.speedup(bench.rows[0]) == pytest.approx(10.0)
    assert math.isnan(bench.rows[0]["gather_sdpa_TBps"]) and len(bench.refusals) == 1


def test_the_environment_variable_wins(tmp_path, monkeypatch):
    folder = results_tree(tmp_path / "elsewhere")
    monkeypatch.setenv(br.RESULTS_ENV, str(folder))
    monkeypatch.chdir(tmp_path)
    assert br.results_dir() == folder
    assert br.load_flash_benchmark() is not None
    monkeypatch.setenv(br.RESULTS_ENV, str(tmp_path / "empty"))
    assert br.load_flash_benchmark() is None and br.read_decode_benchmark() is None


def test_outside_a_checkout_the_package_checkout_is_used(tmp_path, monkeypatch):
    monkeypatch.delenv(br.RESULTS_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    beside = Path(kvlab.__file__).resolve().parent.parent / "benchmarks" / "results"
    assert br.results_dir() == (beside if beside.is_dir() else None)


def test_explicit_paths_and_checks(tmp_path):
    assert br.load_flash_benchmark(tmp_path / "missing.json") is None
    assert br.read_decode_benchmark(tmp_path / "missing.json") is None
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"env": {}, "rows": [{"batch": 1}]}))
    with pytest.raises(ValueError, match="lacks"):
        br.load_flash_benchmark(bad)
    with pytest.raises(ValueError, match="copy_ceiling_Bps"):
        br.decode_benchmark({"env": {}, "rows": []})
    ratios = br.benchmark_ratios(FLASH)
    assert ratios[0]["kvlab_vs_flash"] == 0.8 and ratios[0]["paged_vs_contiguous"] == 0.8


def test_viz_reads_through_this_module():
    from kvlab.viz import decode, flash

    assert flash.load_flash_benchmark is br.load_flash_benchmark and flash.BENCH_COLUMNS is br.BENCH_COLUMNS
    assert decode.read_decode_benchmark is br.read_decode_benchmark
    assert tuple(key for key, _, _ in decode.BENCH_SERIES) == br.DECODE_COLUMNS


def as_if_installed_at(monkeypatch, site_packages: Path) -> None:
    """kvlab as a non-editable install would have it: the package inside ``site_packages``."""
    monkeypatch.setattr(kvlab, "__file__", str(site_packages / "kvlab" / "__init__.py"))


def test_a_non_editable_install_finds_the_checkout_it_runs_in(tmp_path, monkeypatch):
    monkeypatch.delenv(br.RESULTS_ENV, raising=False)
    as_if_installed_at(monkeypatch, tmp_path / "venv" / "site-packages")
    folder = results_tree(tmp_path / "checkout")
    (tmp_path / "checkout" / "notebooks").mkdir()
    monkeypatch.chdir(tmp_path / "checkout" / "notebooks")
    assert br.results_path(br.FLASH_JSON) == (folder / br.FLASH_JSON).resolve()
    monkeypatch.chdir(tmp_path)                        # outside any checkout: nothing to find
    assert br.results_dir() is None and br.results_path(br.FLASH_JSON) is None
    assert br.load_flash_benchmark() is None and br.read_decode_benchmark() is None


def test_a_folder_without_the_file_does_not_hide_one_that_has_it(tmp_path, monkeypatch):
    monkeypatch.delenv(br.RESULTS_ENV, raising=False)
    as_if_installed_at(monkeypatch, tmp_path / "checkout")          # an editable install's layout
    folder = results_tree(tmp_path / "checkout")
    stray = tmp_path / "elsewhere" / "benchmarks" / "results"
    stray.mkdir(parents=True)
    (stray / br.DECODE_JSON).write_text(json.dumps(DECODE))
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert br.results_path(br.DECODE_JSON) == (stray / br.DECODE_JSON).resolve()    # the working directory first
    assert br.results_path(br.FLASH_JSON) == (folder / br.FLASH_JSON).resolve()     # then beside the package


def test_a_removed_working_directory_is_skipped(tmp_path, monkeypatch):
    monkeypatch.delenv(br.RESULTS_ENV, raising=False)
    as_if_installed_at(monkeypatch, tmp_path / "checkout")
    folder = results_tree(tmp_path / "checkout")
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    assert br.results_dir() == folder.resolve()
    assert br.load_flash_benchmark() is not None


@pytest.mark.parametrize("name", ["", "results/flash_attention.json", "../flash_attention.json", None])
def test_results_path_takes_a_file_name(name):
    with pytest.raises(ValueError, match="name must be a file name"):
        br.results_path(name)
