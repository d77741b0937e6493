#!/usr/bin/env bash
# Build the separate environment for NVIDIA's kvpress (it pins transformers < 5.3, the project
# needs >= 5.8): .venv-kvpress at the repository root, CPU torch from the wheel on disk first.
# Never the project's venv.
set -euo pipefail
cd "$(dirname "$0")/../.."
# The versions it was last tested with: constraints/kvpress.txt (written by
# `scripts/pin_versions.py freeze --python .venv-kvpress/bin/python`); a changed file reinstalls.
VENV=${KVPRESS_VENV:-.venv-kvpress}
PINS=constraints/kvpress.txt
if [ ! -f "$VENV/.installed" ] || ! cmp -s "$PINS" "$VENV/.installed"; then
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
  "$VENV/bin/pip" install -q -c "$PINS" torch==2.13.0
  "$VENV/bin/pip" install -q -c "$PINS" "kvpress==0.5.5"
  cp "$PINS" "$VENV/.installed"
fi
echo "$VENV"
