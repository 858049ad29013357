#!/usr/bin/env bash
# Makes the Python environment the `kiln` Python package is built and tested with: a virtual
# environment (default .venv, or $KILN_VENV) holding nanobind, scikit-build-core, numpy and
# PyTorch (used on the CPU by the tests). Does nothing when everything is there already. Prints the interpreter's
# path as its last line.
#
# PyTorch comes from PyPI with --no-deps: its Linux wheel would otherwise pull several GB of
# NVIDIA libraries that CPU tests do not need; only the four it links at load time come along.
# Measured on the 2-core development machine: ~1.5 GB downloaded, 2.5-3 minutes, 2.1 GB in .venv.
# KILN_PYTHON_TORCH=0 skips torch (the torch tests then skip, saying so); KILN_PYTHON_TRANSFORMERS=0
# skips transformers, KILN_PYTHON_ONNX=0 onnx (the ONNX path of bench/peer/torch_compile_kiln.py).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${KILN_VENV:-$root/.venv}
base_python=${KILN_BASE_PYTHON:-/usr/bin/python3}
[ -x "$base_python" ] || base_python=$(command -v python3)
index=(--index-url https://pypi.org/simple)
start=$(date +%s)

if [ ! -x "$venv/bin/python" ]; then
  if ! "$base_python" -m venv "$venv" 2> /dev/null; then
    # Debian splits ensurepip out of python3 into python3-venv.
    rm -rf "$venv"
    SUDO=""
    if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get install -y -qq --no-install-recommends python3-venv > /dev/null
    "$base_python" -m venv "$venv"
  fi
fi
py="$venv/bin/python"
# The extension module needs the interpreter's headers (Debian: python3-dev).
include=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
if [ ! -f "$include/Python.h" ]; then
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends python3-dev > /dev/null
fi
pip=("$py" -m pip install -q --disable-pip-version-check "${index[@]}")

if ! "$py" -c "import nanobind, numpy, scikit_build_core" 2> /dev/null; then
  echo "setup-python: installing nanobind, scikit-build-core, numpy" >&2
  "${pip[@]}" "nanobind>=2.0" "scikit-build-core>=0.9" "numpy>=1.24" >&2
fi
install_torch() {
  "${pip[@]}" filelock typing-extensions sympy networkx jinja2 fsspec mpmath MarkupSafe >&2 &&
    "${pip[@]}" --no-deps "torch==${KILN_TORCH_VERSION:-2.15.0}" >&2 &&
    # The wheel links these NVIDIA libraries at load time even for CPU use (~500 MB, not the
    # several GB of the full CUDA set).
    "${pip[@]}" --no-deps nvidia-cufile nvidia-cusparselt-cu13 nvidia-nvshmem-cu13 nvidia-nccl-cu13 >&2 &&
    "$py" -c "import torch; torch.ones(1) + 1" >&2
}
if [ "${KILN_PYTHON_TORCH:-1}" != 0 ] && ! "$py" -c "import torch" 2> /dev/null; then
  echo "setup-python: installing torch (used on the CPU; only the CUDA libraries it must load)" >&2
  # Without torch the package still builds; its torch tests skip, saying why.
  install_torch || echo "setup-python: torch could not be installed; the torch tests will skip" >&2
fi
# transformers' own GPT-2 and BERT (tiny configurations, random weights) are among the torch
# tests; without it those tests skip, saying so. ~170 MB, ~30 s.
if [ "${KILN_PYTHON_TORCH:-1}" != 0 ] && [ "${KILN_PYTHON_TRANSFORMERS:-1}" != 0 ] &&
  "$py" -c "import torch" 2> /dev/null && ! "$py" -c "import transformers" 2> /dev/null; then
  echo "setup-python: installing transformers" >&2
  "${pip[@]}" "transformers==${KILN_TRANSFORMERS_VERSION:-5.25.0}" >&2 ||
    echo "setup-python: transformers could not be installed; its tests will skip" >&2
fi
# onnx: bench/peer/torch_compile_kiln.py exports the models to time Kiln's ONNX path beside
# torch.compile (PyTorch's TorchScript exporter writes through it); ~17 MB, a few seconds.
if [ "${KILN_PYTHON_TORCH:-1}" != 0 ] && [ "${KILN_PYTHON_ONNX:-1}" != 0 ] &&
  ! "$py" -c "import onnx" 2> /dev/null && "$py" -c "import torch" 2> /dev/null; then
  echo "setup-python: installing onnx" >&2
  "${pip[@]}" "onnx==${KILN_ONNX_VERSION:-1.23.2}" >&2 || echo "setup-python: onnx could not be installed; the ONNX bench path will skip" >&2
fi
echo "setup-python: ready in $(( $(date +%s) - start )) s: $("$py" -c 'import sys, numpy, nanobind; t = "absent"
try:
    import torch; t = torch.__version__
except Exception: pass
print(f"python {sys.version.split()[0]}, numpy {numpy.__version__}, nanobind {nanobind.__version__}, torch {t}")')" >&2
echo "$py"
