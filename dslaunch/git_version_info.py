"""``deepspeed.git_version_info``: the version facts DeepSpeed's installer records.

Read by scripts and test suites that check which DeepSpeed and torch they run on (``version``
is the DeepSpeed API level dslaunch follows, as ``compat/deepspeed``'s distribution names it).
``git_hash``/``git_branch`` are "unknown", as in DeepSpeed's PyPI builds.
"""

from __future__ import annotations

import torch

from dslaunch.ops.op_builder import compatible_ops

__all__ = ["version", "git_hash", "git_branch", "installed_ops", "compatible_ops", "accelerator_name",
           "torch_info"]

version = "0.19.8"
git_hash = "unknown"
git_branch = "unknown"
# dslaunch's ops are prebuilt: what runs here is what is installed.
installed_ops = compatible_ops()
accelerator_name = "cuda" if torch.cuda.is_available() else "cpu"
torch_info = {
    "version": ".".join(torch.__version__.split("+")[0].split(".")[:2]),
    "bf16_support": bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported()),
    "cuda_version": ".".join((torch.version.cuda or "0.0").split(".")[:2]),
    "nccl_version": ".".join(map(str, torch.cuda.nccl.version()[:2])) if torch.cuda.is_available() else "0.0",
    "hip_version": "0.0",
}
