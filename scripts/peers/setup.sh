#!/usr/bin/env bash
# Once: a virtual environment with PyTorch and DeepSpeed (CPU wheels) for the
# peers beside zrun (a few minutes, ~5 GB), outside the repository:
#   PEERENV=/tmp/peerenv scripts/peers/setup.sh
# DeepSpeed compiles its CPU ops on first use, which needs gcc and libaio.
set -euo pipefail
PEERENV=${PEERENV:-/tmp/peerenv}
if ! command -v g++ >/dev/null || [ ! -f /usr/include/libaio.h ]; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq gcc g++ libaio-dev
fi
python3 -m venv "$PEERENV/venv"
. "$PEERENV/venv/bin/activate"
pip install -q -U pip wheel setuptools
pip install -q --no-cache-dir torch numpy psutil deepspeed
echo "peers ready: . $PEERENV/venv/bin/activate"
