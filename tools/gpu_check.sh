#!/usr/bin/env bash
# Run on a lent GPU machine (the `device` tool), from the repository root:
#   bash tools/gpu_check.sh        -> writes $OUT/gpu_check.json (or ./gpu_check.json)
# Installs nothing beyond what the machine has when torch with CUDA is already there;
# otherwise installs the package without its torch pin first.
set -euo pipefail
out="${OUT:-.}"
python3 -c "import torch; assert torch.cuda.is_available()" 2>/dev/null || { echo "no CUDA torch here"; exit 2; }
python3 -m pip install -q --no-deps -e . >/dev/null 2>&1 || true
python3 -m pip install -q safetensors fsspec blake3 rich click >/dev/null 2>&1 || true
PYTHONUNBUFFERED=1 python3 tools/gpu_check.py --out "$out/gpu_check.json"
