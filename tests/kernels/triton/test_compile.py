"""Every Triton kernel compiles for a GPU (sm_90, down to a cubin with Triton's bundled ptxas)
without one: the interpreter runs Python semantics and misses what only the compiler refuses (a
non-constexpr global read by a kernel, a bad pointer cast, a None pointer used).

Compiled in a child process without ``TRITON_INTERPRET`` (set for this directory by conftest.py)
and with an empty cache, for each constexpr flag on and off and each dtype at least once."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

_COMPILE_ALL = r'''
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from dslaunch.kernels.triton import adam, bias_gelu, cross_entropy, norms

def compile(fn, sig, const):
    sig = {**sig, **{k: "constexpr" for k in const}}
    triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const), target=GPUTarget("cuda", 90, 32))
    print("compiled", fn.__name__, const)

for p, g, w, u, d in [("fp32", "fp32", True, True, True), ("bf16", "bf16", False, False, True),
                      ("fp16", "fp32", True, False, False)]:
    compile(adam._adam_kernel, {**{k: "*i64" for k in ("p_tab", "g_tab", "m_tab", "v_tab", "numel_tab", "chunk_tensor",
                                                        "chunk_offset")},
                                "p_proto": "*" + p, "g_proto": "*" + g, "m_proto": "*fp32", "v_proto": "*fp32",
                                **{k: "fp32" for k in ("lr", "beta1", "beta2", "eps", "weight_decay", "step_size",
                                                       "inv_sqrt_bc2", "inv_scale")}},
            {"ADAM_W": w, "DECAY": d, "UNSCALE": u, "BLOCK": adam.BLOCK})
for rms, affine, dt in [(False, True, "bf16"), (False, False, "fp32"), (True, True, "fp16"), (True, False, "bf16")]:
    flags = {"RMS": rms, "HAS_W": affine, "HAS_B": affine and not rms, "BLOCK": 4096}
    none = {**({} if affine else {"W": None}), **({} if affine and not rms else {"B": None})}
    compile(norms._norm_fwd, {"X": "*" + dt, "Y": "*" + dt, "Mean": "*fp32", "Rstd": "*fp32", "stride_x": "i32",
                              "stride_y": "i32", "N": "i32", "eps": "fp32",
                              **{k: "*" + dt for k in ("W", "B") if k not in none}}, {**flags, **none})
    none.pop("B", None)
    compile(norms._norm_bwd, {"X": "*" + dt, "DY": "*" + dt, "DX": "*" + dt, "Mean": "*fp32", "Rstd": "*fp32",
                              "DW": "*fp32", "DB": "*fp32", **{k: "i32" for k in ("M", "N", "stride_x", "stride_dy",
                                                                                  "stride_dx")},
                              **({"W": "*" + dt} if affine else {})}, {**flags, **none})
for tanh, dropout, backward in [(False, False, False), (False, True, True), (True, True, False), (True, False, True)]:
    compile(bias_gelu._bias_gelu_kernel, {"X": "*bf16", "B": "*bf16", "OUT": "*bf16", "numel": "i32", "n": "i32",
                                          "p": "fp32", "scale": "fp32", "seed": "i32",
                                          **({"DY": "*bf16"} if backward else {})},
            {"TANH": tanh, "DROPOUT": dropout, "BACKWARD": backward, "BLOCK": 1024, **({} if backward else {"DY": None})})
for dt in ("fp32", "bf16", "fp16"):
    compile(cross_entropy._forward_kernel, {"LOGITS": "*" + dt, "TARGET": "*i64", "LSE": "*fp32", "LOSS": "*fp32",
                                            "vocab": "i32", "ignore_index": "i32"}, {"BLOCK": 1024})
    compile(cross_entropy._backward_kernel, {"LOGITS": "*" + dt, "TARGET": "*i64", "LSE": "*fp32", "SCALE": "*fp32",
                                             "GRAD": "*" + dt, "vocab": "i32", "ignore_index": "i32"}, {"BLOCK": 1024})
print("all compiled")
'''


def test_every_kernel_compiles_for_sm90(tmp_path: Path) -> None:
    pytest.importorskip("triton", reason="triton is not installed (make setup installs the 'triton' extra)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1")
    out = subprocess.run([sys.executable, "-c", _COMPILE_ALL], env=env, capture_output=True, text=True, timeout=140)
    assert out.returncode == 0 and out.stdout.rstrip().endswith("all compiled"), (out.stdout[-1500:] + out.stderr[-3000:])
