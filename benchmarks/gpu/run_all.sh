#!/usr/bin/env bash
# meshkit's GPU checks in one run, one JSON of figures (see benchmarks/gpu/run_all.py for the sections).
#   benchmarks/gpu/run_all.sh [--cpu|--dry-run] [OUT.json]     default OUT.json: $OUT/gpu_figures.json
# Exits 0 when every section was ok, 1 otherwise; the JSON is written either way.
set -u
cd "$(dirname "$0")/../.." || exit 2
exec "${PYTHON:-python}" benchmarks/gpu/run_all.py "$@"
