#!/usr/bin/env bash
# benchmarks/gpu_check.sh — prove the GPU path in one short run, or show exactly what breaks.
#
#   bash benchmarks/gpu_check.sh                      # every section, 420 s in all
#   bash benchmarks/gpu_check.sh --budget 300 train   # only the named sections
#   bash benchmarks/gpu_check.sh --dry-run            # on the CPU at tiny sizes (tests the script)
#   bash benchmarks/gpu_check.sh --help               # the sections and what each checks
#
# It runs from this checkout as it is (PYTHONPATH; nothing is installed or downloaded) with
# $PYTHON, else .venv/bin/python, else python3. The work is in benchmarks/gpu_check.py.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=$(command -v python3)
export PYTHON="$PY"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" benchmarks/gpu_check.py "$@"
