#!/usr/bin/env bash
# Installs moe's dependencies from Debian packages. Idempotent: installs only what is missing.
# Usage: scripts/setup.sh          # what building and running `moe` needs
#        scripts/setup.sh --test   # plus the test references (python3-torch) and chromium (the report's
#                                  # headless rendering test)
set -euo pipefail
packages=(build-essential cmake pkg-config libdnnl-dev libopenblas-dev libcli11-dev nlohmann-json3-dev
          libgtest-dev libgmock-dev python3.11-doc openmpi-bin libopenmpi-dev iproute2 libcpp-httplib-dev)
if [[ "${1:-}" == "--test" ]]; then
  packages+=(python3-torch python3-numpy chromium)
fi
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if (( ${#missing[@]} == 0 )); then
  echo "setup: all ${#packages[@]} packages present"
  exit 0
fi
echo "setup: installing ${missing[*]}"
sudo=""; [[ $(id -u) -ne 0 ]] && sudo="sudo"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "setup: done"
