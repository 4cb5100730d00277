#!/usr/bin/env bash
# The checks that need a CUDA device (issue 21), in one go, sized for a short run on a GPU
# machine (about ten minutes; `run` with timeout_s 600):
#
#   bash scripts/gpu_check.sh            # set up .venv (torch with CUDA), run the GPU tests
#
# Installs what it needs (the venv with the `test` and `torch` extras; torch's wheel
# brings the CUDA runtime), prints the device, then runs the tests that skip without a
# GPU, with -rs so a skip still shows why. Exits non-zero when a test fails or when no
# CUDA device is visible (the point of the run is the device). Everything that runs
# without a GPU is in CI already.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
# shellcheck source=scripts/venv.sh
. scripts/venv.sh
HIXL_EXTRAS=${HIXL_EXTRAS:-test,torch} hixl_ensure_venv "$root"
.venv/bin/python - <<'PY'
import sys
import torch
if not torch.cuda.is_available():
    sys.exit("gpu_check: no CUDA device visible to torch "
             f"(torch {torch.__version__}, built for CUDA {torch.version.cuda})")
print(f"gpu_check: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
      f"CUDA {torch.version.cuda}")
PY
exec .venv/bin/python -m pytest -q -rs tests/test_device_memory.py "$@"
