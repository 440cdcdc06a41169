"""DeepSpeed's ``deepspeed.runtime.comm`` path: collectives over several tensors at once."""
