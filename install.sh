#!/usr/bin/env bash
# One install step for a fresh Debian/Ubuntu root shell (also used by the Vagrant VM and CI):
# system tools the testbed drives, then a virtual environment with the Python packages: .venv, or
# $NEZHA_VENV if set (an absolute path, or one relative to this folder). The Vagrant VM sets
# NEZHA_VENV=/opt/nezha-venv: a venv is made of symlinks, which VirtualBox shared folders refuse,
# and a Linux venv does not belong in the host's checkout. ./tb and `python3 -m testbed` find it
# the same way. Idempotent: it does the work again only when this script or pyproject.toml changed.
set -euo pipefail
cd "$(dirname "$0")"
venv=${NEZHA_VENV:-.venv}

if [ "$(id -u)" -ne 0 ]; then
    echo "install.sh: run as root (network namespaces and tc need it): sudo ./install.sh" >&2
    exit 2
fi

stamp="$venv/.installed"
want=$(cat install.sh pyproject.toml | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ "${1:-}" != "--force" ]; then
    exit 0
fi

# ruby only for the test suite's Vagrantfile syntax check (tests/test_readme.py)
packages=(iproute2 nftables iptables iperf3 mininet bridge-utils ethtool tcpdump procps iputils-ping util-linux kmod python3 python3-venv python3-pip ruby)
missing=()
for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "install.sh: installing system packages: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
# netem lives in a module on stock kernels; load it where it exists (no error where it does not).
modprobe sch_netem 2>/dev/null || true

python=${PYTHON:-python3}
if [ ! -x "$venv/bin/python" ]; then
    mkdir -p "$(dirname "$venv")"
    "$python" -m venv "$venv"
fi
"$venv/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
"$venv/bin/python" -m pip install -q -e .
echo "$want" > "$stamp"
echo "install.sh: ready ($venv/bin/python -m testbed doctor shows what this kernel can emulate)"
