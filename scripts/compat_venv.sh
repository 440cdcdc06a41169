#!/usr/bin/env bash
# Builds .venv-compat: the Hugging Face side of the tests (tests/compat/). It holds dslaunch, the
# `deepspeed` compatibility distribution (compat/deepspeed) and pinned transformers and accelerate,
# and never a real DeepSpeed. torch is pinned to the main venv's build, so pip never pulls another
# (a CUDA build is GBs). A failed build (no network, say) does not fail `make test`: it leaves
# VENV/BUILD_FAILED with pip's last lines, and the compat tests skip, quoting it.
# The fine-tuning stack (trl, peft, datasets) goes in second, on its own: if only it fails,
# VENV/FINETUNE_FAILED says why and only the TRL/PEFT tests skip.
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
finetune() {
    "$venv/bin/pip" install -q -c "$venv/constraints.txt" trl==1.16.0 peft==0.21.0 datasets==5.2.0 &&
    "$venv/bin/python" -c "import trl, peft, datasets"
}
# Records why a step failed (pip's last lines) in $1 and says so.
failed() {
    grep -v '^WARNING: Location' "$log" | tail -n 5 > "$venv/$1"
    echo "compat_venv: $2: $(tail -n 1 "$venv/$1")"
}
if build >"$log" 2>&1; then
    touch "$venv/.installed"
    if finetune >"$log" 2>&1; then
        touch "$venv/.installed-finetune"
    else
        failed FINETUNE_FAILED "could not add trl/peft/datasets to $venv (the TRL tests will skip)"
    fi
else
    mkdir -p "$venv"
    failed BUILD_FAILED "could not build $venv (the compat tests will skip)"
fi
rm -f "$log"
