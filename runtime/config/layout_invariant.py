"""The ds_config ``layout_invariant`` block: training whose bits do not depend on the parallel
layout (dslaunch's own, not DeepSpeed's). Torch-free.

``{"layout_invariant": {"enabled": true, "chunks": 4}}``: every reduction whose operands a layout
splits differently (a tensor-parallel matmul's inner dimension, a gradient summed over data or
expert-data ranks and accumulation steps, the global gradient norm) is computed in one fixed order
of ``chunks`` pieces, whatever the tensor, expert or data degree. So a job saved at one layout and
resumed at another continues bit for bit as a job that ran at the new layout from the start
(fp32; the same global batch). Degrees must divide ``chunks``. It costs speed: the pieces are
separate matmuls and the reductions fixed trees, not the fastest collective.
"""

from __future__ import annotations

from dataclasses import dataclass

from dslaunch.runtime.config.param_schema import boolean, integer
from dslaunch.runtime.config.sections import _opt

__all__ = ["LayoutInvariantConfig"]


@dataclass(frozen=True)
class LayoutInvariantConfig:
    """``layout_invariant``: reductions in a fixed order of ``chunks`` pieces at any layout."""

    enabled: bool = _opt(False, boolean, "true or false")
    chunks: int = _opt(4, integer(1, 1024), "an integer from 1 to 1024: the pieces every split reduction is "
                       "cut into (each tensor, expert and data degree must divide it)")

    UNIMPLEMENTED = {}  # noqa: RUF012
