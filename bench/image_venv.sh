#!/usr/bin/env bash
# A venv on this CPU machine that matches the H200 image's Python side: torch 2.11 (PyPI's CUDA build, which
# imports and runs on the CPU), triton 3.6, no torchrec, no C++ extension. Run the suite there before a device
# run of it, to meet the image's failures here (torch 2.11's gloo has no list all_to_all, for one):
#   bash bench/image_venv.sh                  # once (about 5 minutes): VENV=/tmp/gemzoo-image-venv by default
#   GEMZOO_NO_EXTENSION=1 /tmp/gemzoo-image-venv/bin/python -m pytest -q -c pyproject.toml [paths]
set -euo pipefail
VENV=${VENV:-/tmp/gemzoo-image-venv}
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q torch==2.11.0 numpy pluggy safetensors rich pytest pytest-timeout matplotlib tensorboard \
  wheel setuptools ninja
plugins=$(for p in plugins/gemzoo-*/; do printf -- '-e %s ' "${p%/}"; done)
# shellcheck disable=SC2086
GEMZOO_NO_EXTENSION=1 "$VENV/bin/pip" install -q --no-deps --no-build-isolation -e . $plugins
"$VENV/bin/python" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
