"""DeepSpeed's ``deepspeed.runtime.zero.stage_1_and_2`` import path: its memory estimator.

``DeepSpeedZeroOptimizer`` is ``engine.optimizer`` at stages 1 and 2 (``optimizer_view.py``; the
stages themselves are ``stage1.py`` and ``stage2.py``); this module otherwise only carries the
estimator functions DeepSpeed users call from here (DeepSpeed's formulas and table, unchanged:
``runtime/estimate/deepspeed_formulas.py``). ``dslaunch estimate`` is dslaunch's own estimate.
"""

from dslaunch.runtime.estimate.deepspeed_formulas import (
    count_params as _count_params,
)
from dslaunch.runtime.estimate.deepspeed_formulas import (
    estimate_zero2_model_states_mem_needs,
    estimate_zero2_model_states_mem_needs_all_cold,
    estimate_zero2_model_states_mem_needs_all_live,
)
from dslaunch.runtime.zero.optimizer_view import DeepSpeedZeroOptimizer

__all__ = ["DeepSpeedZeroOptimizer", "estimate_zero2_model_states_mem_needs", "estimate_zero2_model_states_mem_needs_all_live",
           "estimate_zero2_model_states_mem_needs_all_cold", "model_to_params"]


def model_to_params(model):
    """Trainable and frozen parameters of ``model``, a shared tensor counted once (DeepSpeed's)."""
    return _count_params(model.parameters())
