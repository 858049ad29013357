#!/usr/bin/env bash
# Installs the Debian packages Kiln's build needs; does nothing when all are present.
set -euo pipefail

PACKAGES=(
  cmake ninja-build g++ make pkg-config
  llvm-19-dev llvm-19-tools libzstd-dev
  libtomlplusplus-dev doctest-dev
  libboost-dev libssl-dev
  libonnx-dev libonnx-testdata libprotobuf-dev protobuf-compiler
  libopenblas-dev
  python3 python3-numpy
)

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#PACKAGES[@]} packages present"
  exit 0
fi

echo "install-deps: installing ${missing[*]}"
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
