#!/usr/bin/env bash
# The wheels scripts/gpu/check.sh installs on a GPU machine that has no network, for Linux x86-64
# and the given CPython version (default 3.12, the GPU image's), into ./.whl (git-ignored; carry it
# with the working tree: scripts/gpu/carry.txt lists what travels):
#   .whl/*.whl            dslaunch's dependencies the image lacks (paramiko and its needs, crc32c)
#   .whl/deepspeed/       real DeepSpeed 0.19.8, built here as a pure-Python wheel (no op prebuilt:
#                         they JIT-build there), and the closure of its requirements but torch and
#                         numpy (the image's own builds, which a wheel from here must not replace)
# When this machine's Python is another version, the binary ones among DeepSpeed's requirements
# are also fetched for it into ./.whl-local/deepspeed (not carried), so that the check without a
# GPU installs DeepSpeed from the same wheel here.
#   scripts/gpu/wheels.sh [PYTHON_VERSION]     (needs PyPI, and a Python with torch: .venv's)
set -euo pipefail
cd "$(dirname "$0")/../.."
version=${1:-3.12}
DEEPSPEED=deepspeed==0.19.8
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
platforms=()
for p in manylinux_2_34 manylinux_2_28 manylinux_2_27 manylinux_2_26 manylinux_2_17 manylinux2014 manylinux_2_5 manylinux1; do
    platforms+=(--platform "${p}_x86_64")
done
# fetch VERSION DIR REQUIREMENT...: binary wheels for CPython VERSION on Linux x86-64
fetch() {
    local v=$1 dir=$2
    shift 2
    "$PY" -m pip download -q --only-binary=:all: --python-version "$v" --implementation cp \
        "${platforms[@]}" -d "$dir" "$@"
}
fetch "$version" .whl --no-deps paramiko bcrypt cryptography pynacl cffi pycparser invoke crc32c

# DS_BUILD_OPS=0: nothing compiled here (setup.py only records which ops were prebuilt: none).
mkdir -p .whl/deepspeed
DS_BUILD_OPS=0 DS_ACCELERATOR=cpu "$PY" -m pip wheel -q --no-deps --no-build-isolation -w .whl/deepspeed "$DEEPSPEED"
# Its requirements as its metadata names them (extras left out), torch and numpy excepted.
mapfile -t requires < <(unzip -p .whl/deepspeed/deepspeed-*.whl '*.dist-info/METADATA' \
    | sed -n 's/^Requires-Dist: //p' | grep -v 'extra ==' | grep -v -E '^(torch|numpy)([^a-zA-Z0-9_.-]|$)')
fetch "$version" .whl/deepspeed "${requires[@]}"
rm -f .whl/deepspeed/torch-*.whl .whl/deepspeed/numpy-*.whl .whl/deepspeed/nvidia_*.whl .whl/deepspeed/triton-*.whl
here=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
if [ "$here" != "$version" ]; then
    fetch "$here" .whl-local/deepspeed "${requires[@]}"
    rm -f .whl-local/deepspeed/torch-*.whl .whl-local/deepspeed/numpy-*.whl
fi
ls .whl .whl/deepspeed
du -sh .whl
