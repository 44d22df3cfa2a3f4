#!/usr/bin/env bash
# The README's install lines on a fresh venv: the package and an extra from the checkout, then the extra's import.
#     tools/install_check.sh [EXTRA]        (default: transformers)
# torch is installed first from the same pin as the dev set-up (pip's cache makes it a copy, not a download).
set -euo pipefail
cd "$(dirname "$0")/.."
extra="${1:-transformers}"
venv="$(mktemp -d)/venv"
trap 'rm -rf "$(dirname "$venv")"' EXIT
python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q -c constraints-dev.txt torch==2.13.0
"$venv/bin/python" -m pip install -q -c constraints-dev.txt ".[$extra]"
case "$extra" in
  transformers) module=verified_ckpt.integrations.transformers ;;
  lightning) module=verified_ckpt.integrations.lightning ;;
  service) module=verified_ckpt.service.app ;;
  *) module=verified_ckpt ;;
esac
"$venv/bin/python" -c "import $module, verified_ckpt; print('installed from the checkout:', verified_ckpt.__version__, '+ $extra')"
"$venv/bin/vckpt" --help > /dev/null
