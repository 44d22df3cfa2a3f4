#!/usr/bin/env bash
# Run on a lent GPU machine (the `device` tool), from the repository root. Its image has torch with CUDA but
# neither blake3 nor zarr, and no network: carry them as wheels (see the device README), e.g. here:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl blake3 zarr numcodecs donfig crc32c
# and run with carry [".whl"]:   bash tools/gpu_check.sh   -> $OUT/gpu_check.json (under 8 minutes; extra
# arguments go to gpu_check.py, e.g. `bash tools/gpu_check.sh --sections guard_cost` for issue 51's figures alone)
set -euo pipefail
out="${OUT:-.}"
python3 -c "import torch; assert torch.cuda.is_available()" 2>/dev/null || { echo "no CUDA torch here"; exit 2; }
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
PYTHONUNBUFFERED=1 python3 tools/gpu_check.py --out "$out/gpu_check.json" "$@"
