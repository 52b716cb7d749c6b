#!/usr/bin/env bash
# Everything the course verifies on a GPU, in one go, for a machine with no package index:
# install kvlab, run the doctor, the test suite in the gpu profile, the benchmarks, and
# re-execute the notebooks. Results (logs, JSON, executed notebooks) go to one archive.
#
#   bash benchmarks/gpu_run.sh [all|tests|bench|notebooks]...     (default: all)
#
# Wheels for Jupyter's kernel stack and nbval, when the machine lacks them, are taken from
# .whl/ (filled by a helper script on a machine with an index).
set -uo pipefail
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT/logs" "$OUT/bench"
steps=${*:-all}
want() { [[ " $steps " == *" all "* || " $steps " == *" $1 "* ]]; }

if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site JUPYTER_PATH=/tmp/site/share/jupyter PATH=/tmp/site/bin:$PATH
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >"$OUT/logs/install.log" 2>&1 \
  || { echo "editable install failed (see install.log); using PYTHONPATH"; ln -sfn ../kernels kvlab/kernels; }
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/logs/gpu.log"
python3 -m kvlab.cli check 2>&1 | tee "$OUT/logs/check.log"

if want tests; then
  KVLAB_PROFILE=gpu python3 -m pytest tests -q -p no:cacheprovider 2>&1 | tee "$OUT/logs/tests.log" | tail -5
fi
if want bench; then
  # the GPU benchmarks (bench_block_hash.py measures the CPU and runs elsewhere)
  for b in benchmarks/bench_write_kv.py benchmarks/bench_copy_blocks.py benchmarks/bench_paged_decode.py \
           benchmarks/bench_flash_attention.py benchmarks/bench_matvec.py benchmarks/bench_engine.py; do
    python3 "$b" --out "$OUT/bench" 2>&1 | tee "$OUT/logs/$(basename "$b" .py).log"
  done
fi
if want notebooks; then
  python3 -m kvlab.notebooks run notebooks/*.ipynb 2>&1 | grep -v "WARNING | Kernel is running" | tee "$OUT/logs/notebooks.log"
  mkdir -p "$OUT/notebooks" && cp notebooks/*.ipynb "$OUT/notebooks/"
fi
tar czf "$OUT/results.tgz" -C "$OUT" logs bench $( [ -d "$OUT/notebooks" ] && echo notebooks )
rm -rf "$OUT/logs" "$OUT/bench" "$OUT/notebooks"
