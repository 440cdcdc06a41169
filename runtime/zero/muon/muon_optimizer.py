"""DeepSpeed's ``deepspeed.runtime.zero.muon.muon_optimizer`` (the class ``"type": "Muon"`` builds)."""

from dslaunch.runtime.optim.muon import MuonWithAuxAdam

__all__ = ["MuonWithAuxAdam"]
