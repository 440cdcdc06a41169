"""``deepspeed.checkpointing`` under dslaunch's name: ``dslaunch.checkpointing.checkpoint(fn, *args)``.

Defined in ``dslaunch.runtime.activation_checkpointing.checkpointing`` (DeepSpeed's path for them
too); see there. Importing this module imports torch.
"""

from dslaunch.runtime.activation_checkpointing.checkpointing import (
    CheckpointSettings,
    CudaRNGStatesTracker,
    checkpoint,
    configure,
    get_cuda_rng_tracker,
    is_configured,
    model_parallel_cuda_manual_seed,
    model_parallel_reconfigure_tp_seed,
    non_reentrant_checkpoint,
    profile_totals,
    reset,
    set_num_layers,
    settings,
)

__all__ = ["configure", "is_configured", "checkpoint", "non_reentrant_checkpoint", "reset", "set_num_layers",
           "get_cuda_rng_tracker", "model_parallel_cuda_manual_seed", "model_parallel_reconfigure_tp_seed",
           "CudaRNGStatesTracker",
           "CheckpointSettings", "settings", "profile_totals"]
