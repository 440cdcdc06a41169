#!/usr/bin/env bash
# The wheels scripts/gpu/check.sh installs on a GPU machine that has no network: dslaunch's
# dependencies its Python image lacks (paramiko and its needs, crc32c), for Linux x86-64 and the
# given CPython version, into ./.whl (git-ignored; carry it with the working tree).
#   scripts/gpu/wheels.sh [PYTHON_VERSION]     (default 3.12, the GPU image's)
set -euo pipefail
cd "$(dirname "$0")/../.."
version=${1:-3.12}
platforms=()
for p in manylinux_2_34 manylinux_2_28 manylinux_2_27 manylinux_2_26 manylinux_2_17 manylinux2014 manylinux_2_5 manylinux1; do
    platforms+=(--platform "${p}_x86_64")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$version" --implementation cp \
    "${platforms[@]}" -d .whl paramiko bcrypt cryptography pynacl cffi pycparser invoke crc32c
ls .whl
