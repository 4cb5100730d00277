#!/usr/bin/env bash
# The checks that need a CUDA device (issue 21), in one go, sized for a short run on a GPU
# machine (a few minutes; give `run` timeout_s 600):
#
#   bash scripts/gpu_check.sh                  # the GPU tests, then scripts/gpu_bench.py
#   bash scripts/gpu_check.sh --fetch-wheels   # beforehand, where pip reaches PyPI (below)
#
# The GPU tests: tests/test_device_memory.py (D2rH / rH2D on the mapped and socket paths
# with every byte checked; a tensor resized / memory freed after registration, another
# device than the stream's, a non-contiguous tensor: typed errors) and
# tests/test_device_staging.py (the same pipelines with host memory standing in), with -rs
# so a skip says why. Then the device benchmark: mapped D2rH / rH2D of 8784 KiB against a
# plain device<->pinned copy, TCP from/to the device against TCP from/to host memory,
# and one 4 KiB op's p50, as same-run ratios (written to $OUT/gpu_bench.json when $OUT is
# set); then hixl bench's HIXL-style run with the local side on the device. Exits
# non-zero when a test or a step fails, or when no CUDA device is visible.
#
# Which Python: $HIXL_PYTHON, else python3 when its torch sees a CUDA device (GPU machines
# with a framework image; they may reach no package index), with hixl installed into it
# editable and without dependencies; else the repo's .venv with the `test` and `torch`
# extras (torch's wheel brings the CUDA runtime). Wheels in .whl/ (cp312, manylinux) are
# installed first, with --no-index: --fetch-wheels puts there the ones hixl needs newer
# than such an image may hold (protobuf >= 7.35, grpcio 1.85.1: its generated code checks
# both) and pytest-asyncio; carry .whl along (`echo /.whl/ >> .git/info/exclude`).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

if [[ ${1:-} == --fetch-wheels ]]; then
    mkdir -p .whl
    for spec in "protobuf>=7.35" "grpcio==1.85.1" "pytest-asyncio>=0.23"; do
        python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
            --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
            --platform manylinux2014_x86_64 --platform any -d .whl "$spec"
    done
    ls -l .whl
    exit 0
fi

py=${HIXL_PYTHON:-}
if [[ -z $py ]] && python3 -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' \
        2>/dev/null; then
    py=python3
fi
if [[ -n $py ]]; then
    if compgen -G ".whl/*.whl" >/dev/null; then
        site=$(mktemp -d /tmp/hixl-wheels.XXXXXX)
        "$py" -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/*.whl
        export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    fi
    "$py" -m pip install -q --no-index --no-deps --no-build-isolation -e . >&2
else
    # shellcheck source=scripts/venv.sh
    . scripts/venv.sh
    HIXL_EXTRAS=${HIXL_EXTRAS:-test,torch} hixl_ensure_venv "$root"
    py=.venv/bin/python
fi
"$py" - <<'PY'
import sys
import torch
if not torch.cuda.is_available():
    sys.exit("gpu_check: no CUDA device visible to torch "
             f"(torch {torch.__version__}, built for CUDA {torch.version.cuda})")
print(f"gpu_check: {torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}, "
      f"torch {torch.__version__}, CUDA {torch.version.cuda}", flush=True)
PY
status=0
PYTHONUNBUFFERED=1 "$py" -m pytest -q -rs -p no:cacheprovider tests/test_device_memory.py \
    tests/test_device_staging.py "$@" || status=$?
PYTHONUNBUFFERED=1 timeout 300 "$py" scripts/gpu_bench.py ${OUT:+--json "$OUT/gpu_bench.json"} \
    || status=$?
# hixl bench's HIXL-style run (100 transfers of 8784 KiB per cell) with the local side on
# the device: `hixl bench --hixl-style --local-memory cuda`, its report checked
PYTHONUNBUFFERED=1 timeout 300 "$py" -c '
from hixl.tools import bench, cli
args = ["bench", "--hixl-style", "--local-memory", "cuda", "--mooncake", "off", "--no-progress"]
report = bench.run_bench(cli.bench_config(cli.build_parser().parse_args(args)))
print(bench.format_report(report))
assert all(cell["local_memory"] == "cuda" for cell in report["hixl_style"])
' || status=$?
exit "$status"
