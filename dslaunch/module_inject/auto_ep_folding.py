"""``deepspeed.module_inject.auto_ep_folding``: the rank tables and config rules of AutoEP folded
with AutoTP (``dslaunch.runtime.moe.folding``; pure arithmetic, no process group).

DeepSpeed's per-family gradient corrections of a folded run (``mark_autoep_folding_*``,
``autoep_folding_gradient_reduction_strategy``: a tensor-group sum, average or ``1 / tp`` per
parameter family after the backward) are refused on use: dslaunch's folded backward gives every
parameter its gradient directly (``dslaunch.runtime.moe.autoep_folded``). Their strategy names are
DeepSpeed's strings."""

from dslaunch.runtime.moe import folding
from dslaunch.utils.refused import Refusal, refuse

# bound below from runtime.moe.folding (the same objects), hence F822
__all__ = ["FoldingGroupHandles", "FoldingGroupTables", "ParallelFoldingSpec",  # noqa: F822
           "assert_group_matches_spec", "build_folding_spec", "expected_folding_group_tables",  # noqa: F822
           "local_folding_ranks", "validate_folding_global",  # noqa: F822
           "AUTOEP_FOLDING_GRAD_REDUCE_SKIP", "AUTOEP_FOLDING_GRAD_REDUCE_SUM", "AUTOEP_FOLDING_GRAD_REDUCE_AVERAGE",
           "AUTOEP_FOLDING_GRAD_REDUCE_EXPERT_TP_CANCEL", "autoep_folding_gradient_reduction_strategy",  # noqa: F822
           "mark_autoep_folding_router_parameter", "mark_autoep_folding_partial_router_parameter",  # noqa: F822
           "mark_autoep_folding_sp_sharded_layernorm_parameter"]  # noqa: F822

globals().update({name: getattr(folding, name) for name in __all__[:8]})

AUTOEP_FOLDING_GRAD_REDUCE_SKIP = "skip"
AUTOEP_FOLDING_GRAD_REDUCE_SUM = "sum"
AUTOEP_FOLDING_GRAD_REDUCE_AVERAGE = "average"
AUTOEP_FOLDING_GRAD_REDUCE_EXPERT_TP_CANCEL = "expert_tp_cancel"

_CORRECTIONS = Refusal("DeepSpeed's per-family gradient corrections of AutoEP folded with AutoTP (dslaunch's folded "
                       "backward gives each parameter its gradient directly, with no correction after it)",
                       "nothing to mark or reduce: train the folded model as it is")
globals().update(refuse(__name__, ("autoep_folding_gradient_reduction_strategy", "mark_autoep_folding_router_parameter",
                                   "mark_autoep_folding_partial_router_parameter",
                                   "mark_autoep_folding_sp_sharded_layernorm_parameter"), _CORRECTIONS))
