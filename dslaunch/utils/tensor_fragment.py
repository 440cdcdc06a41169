"""``deepspeed.utils.tensor_fragment``: DeepSpeed's per-parameter ZeRO state accessors
(``safe_get/set_full_*``, ``safe_get/set_local_*``; ``runtime/zero/full_state.py`` and
``local_state.py``) and its ``fragment_address`` record (``runtime/zero/fragment.py``), which
scripts list in ``torch.serialization.add_safe_globals`` to load DeepSpeed's files."""

from dslaunch.runtime.zero.fragment import fragment_address
from dslaunch.runtime.zero.full_state import (
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_grad,
    safe_set_full_optimizer_state,
    safe_update_full_grad_vectorized,
)
from dslaunch.runtime.zero.local_state import (
    safe_get_local_fp32_param,
    safe_get_local_grad,
    safe_get_local_optimizer_state,
    safe_set_local_fp32_param,
    safe_set_local_grad,
    safe_set_local_optimizer_state,
)

__all__ = ["fragment_address", "safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
           "safe_set_full_fp32_param", "safe_set_full_grad", "safe_set_full_optimizer_state",
           "safe_update_full_grad_vectorized", "safe_get_local_fp32_param", "safe_get_local_grad",
           "safe_get_local_optimizer_state", "safe_set_local_fp32_param", "safe_set_local_grad",
           "safe_set_local_optimizer_state"]
