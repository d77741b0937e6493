#!/usr/bin/env bash
# Build the separate environment for NVIDIA's kvpress (it pins transformers < 5.3, the project
# needs >= 5.8): .venv-kvpress at the repository root, CPU torch from the wheel on disk first.
# Never the project's venv.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${KVPRESS_VENV:-.venv-kvpress}
if [ ! -f "$VENV/.installed" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
  "$VENV/bin/pip" install -q torch==2.13.0
  "$VENV/bin/pip" install -q "kvpress==0.5.5"
  touch "$VENV/.installed"
fi
echo "$VENV"
