#!/usr/bin/env bash
# Sets up a fresh machine for plug_asgd: a virtual environment in .venv with the CPU build of
# torch (pinned in constraints.txt), the package with its dev tools, and Fashion-MNIST from
# Debian's packages for the real-data tests and the README's main job. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
.venv/bin/python -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[dev]'

fashion=/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz
if [ ! -f "$fashion" ]; then
    if [ "$(id -u)" = 0 ]; then apt_get="apt-get"
    elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then apt_get="sudo apt-get"
    else apt_get=""; fi
    if [ -n "$apt_get" ] && command -v apt-get >/dev/null; then
        DEBIAN_FRONTEND=noninteractive $apt_get update -qq
        DEBIAN_FRONTEND=noninteractive $apt_get install -y -qq dataset-fashion-mnist >/dev/null
    else
        echo "setup: Fashion-MNIST is missing and cannot be installed from here:" \
             "run 'sudo apt-get install dataset-fashion-mnist' (its tests are skipped until then)" >&2
    fi
fi
echo "setup: ready (.venv/bin/python)"
