"""Activation checkpointing (DeepSpeed's ``deepspeed.runtime.activation_checkpointing``).

``checkpointing.py``: DeepSpeed's API (``configure``, ``checkpoint``, ``non_reentrant_checkpoint``,
the RNG tracker); ``rng.py``: the named RNG states and the snapshot a recompute replays;
``storage.py``: where saved inputs wait (as they are, host memory, split over the model-parallel
group); ``selective.py``: the selective mode's matmul cache; ``offload_activations.py``: ALST's
offload of the hidden states Hugging Face's checkpointed layers save (``cpu_checkpointing`` on
the engine); ``memory.py``: ``LiveBytes``, the memory the tensors created inside a block take
(what the profile reports). Importing it imports
torch.
"""
