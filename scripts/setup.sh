#!/usr/bin/env bash
# Sets up a fresh machine for plug_asgd: a virtual environment in .venv with the CPU build of
# torch (pinned in constraints.txt), the package with its dev tools, and the Debian packages the
# tests use. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
.venv/bin/python -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[dev]'

# Debian packages the tests use: Fashion-MNIST (real-data tests, the README's main job), fortunes
# (the language-model recipe's corpus of fortune cookies) and iproute2 (`ip netns`, for the
# test that puts the PS and the workers on two network "hosts").
packages=()
[ -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ] || packages+=(dataset-fashion-mnist)
[ -f /usr/share/games/fortunes/wisdom ] && [ -f /usr/share/games/fortunes/fortunes ] || packages+=(fortunes)
command -v ip >/dev/null || [ -x /usr/sbin/ip ] || [ -x /sbin/ip ] || packages+=(iproute2)
if [ ${#packages[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ]; then apt_get="apt-get"
    elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then apt_get="sudo apt-get"
    else apt_get=""; fi
    if [ -n "$apt_get" ] && command -v apt-get >/dev/null; then
        DEBIAN_FRONTEND=noninteractive $apt_get update -qq
        DEBIAN_FRONTEND=noninteractive $apt_get install -y -qq "${packages[@]}" >/dev/null
    else
        echo "setup: ${packages[*]} missing and cannot be installed from here:" \
             "run 'sudo apt-get install ${packages[*]}' (the tests that need them are skipped until then)" >&2
    fi
fi
echo "setup: ready (.venv/bin/python)"
