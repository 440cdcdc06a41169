"""Runs ``scenarios.run_all`` with DeepSpeed's compression library, in the DeepSpeed venv.

DeepSpeed 0.19.8 (installed there) removed the library; its last release with it was 0.19.6, whose
source tree the harness has (``DSLAUNCH_DEEPSPEED_SRC``, default /work/ds-src). This script puts that
tree's ``deepspeed/compression`` in front of the installed package's and loads 0.19.6's
``runtime/quantize.py`` (the MoQ quantizer) from it. One workaround, for a DeepSpeed bug: its
scheduler reads ``schedule_offset_end`` of sparse pruning, which its config only sets for
snip_momentum (a KeyError for l1/topk); the reference sets it to ``schedule_offset``, dslaunch's default.

Usage: ``python deepspeed_reference.py OUT.json``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import deepspeed.compression  # noqa: E402
import deepspeed.ops.quantizer  # noqa: E402

SRC = Path(os.environ.get("DSLAUNCH_DEEPSPEED_SRC", "/work/ds-src")) / "deepspeed"
deepspeed.compression.__path__.insert(0, str(SRC / "compression"))
deepspeed.ops.quantizer.ds_quantizer = None  # the CUDA kernel 0.19.6's quantize.py imports (not used here)

import moq_steps  # noqa: E402
import scenarios  # noqa: E402
from deepspeed.compression.compress import init_compression, redundancy_clean, student_initialization  # noqa: E402
from deepspeed.compression.config import get_compression_config  # noqa: E402
from deepspeed.compression.scheduler import compression_scheduler  # noqa: E402


class DeepSpeedApi:
    init_compression = staticmethod(init_compression)
    redundancy_clean = staticmethod(redundancy_clean)
    student_initialization = staticmethod(student_initialization)

    @staticmethod
    def scheduler(model, config):
        sched = compression_scheduler(model, get_compression_config(config))
        sp = sched.different_compression_methods["sparse_pruning"]["shared_parameters"]
        sp.setdefault("schedule_offset_end", sp["schedule_offset"])
        return sched


def _quantizer_class():
    spec = importlib.util.spec_from_file_location("ds_quantize", SRC / "runtime" / "quantize.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Quantizer


if __name__ == "__main__":
    out = scenarios.run_all(DeepSpeedApi)
    out["moq"] = moq_steps.run(_quantizer_class())
    Path(sys.argv[1]).write_text(json.dumps(out))
