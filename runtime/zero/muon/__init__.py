"""DeepSpeed's ``deepspeed.runtime.zero.muon`` import paths; Muon itself is ``runtime/optim/muon.py``."""
