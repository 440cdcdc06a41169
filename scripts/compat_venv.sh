#!/usr/bin/env bash
# Builds .venv-compat: the Hugging Face side of the tests (tests/compat/). It holds dslaunch, the
# `deepspeed` compatibility distribution (compat/deepspeed) and pinned transformers and accelerate,
# and never a real DeepSpeed. torch is pinned to the main venv's build, so pip never pulls another
# (a CUDA build is GBs). A failed build (no network, say) does not fail `make test`: it leaves
# VENV/BUILD_FAILED with pip's last lines, and the compat tests skip, quoting it.
# Usage: compat_venv.sh MAIN_VENV_PYTHON VENV
set -uo pipefail
main_py=$1 venv=$2
rm -rf "$venv"
log=$(mktemp)
build() {
    python3 -m venv "$venv" &&
    echo "torch==$("$main_py" -c 'import torch; print(torch.__version__)')" > "$venv/constraints.txt" &&
    "$venv/bin/pip" install -q -c "$venv/constraints.txt" torch &&
    "$venv/bin/pip" install -q -c "$venv/constraints.txt" -e . -e compat/deepspeed \
        transformers==5.23.0 accelerate==1.15.0 &&
    "$venv/bin/python" -c "import deepspeed, dslaunch, transformers, accelerate; assert deepspeed.comm is dslaunch.comm"
}
if build >"$log" 2>&1; then
    touch "$venv/.installed"
else
    mkdir -p "$venv"
    grep -v '^WARNING: Location' "$log" | tail -n 5 > "$venv/BUILD_FAILED"
    echo "compat_venv: could not build $venv (the compat tests will skip): $(tail -n 1 "$venv/BUILD_FAILED")"
fi
rm -f "$log"
