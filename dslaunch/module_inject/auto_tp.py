"""``deepspeed.module_inject.auto_tp``: DeepSpeed's ``AutoTP`` class (its name-based layer surgery,
``_replace_module`` and the AutoEP shared-expert hook), refused on use: dslaunch's planner works
on the traced dataflow (``dslaunch.runtime.tensor_parallel.auto_tp``), and ``initialize`` shards the
model for training (``tensor_parallel.autotp_size``) or ``init_inference`` for inference."""

from dslaunch.utils.refused import Refusal, refuse

_SURGERY = Refusal("DeepSpeed's AutoTP module surgery class (deepspeed.module_inject.auto_tp.AutoTP)",
                   "let deepspeed.initialize shard the model (tensor_parallel.autotp_size, partition_config for "
                   "hand-written rules) or deepspeed.init_inference(tensor_parallel=...)")

__all__ = ["AutoTP"]  # noqa: F822 (bound below)
globals().update(refuse(__name__, ("AutoTP",), _SURGERY))
