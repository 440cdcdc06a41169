"""DeepSpeed's ``deepspeed.runtime.zero.muon`` import paths (``muon_optimizer.py``,
``original_muon.py``); Muon itself is ``runtime/optim/muon.py``.
"""
