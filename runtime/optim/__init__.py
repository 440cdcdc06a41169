"""Optimizers named by ds_config's ``optimizer.type``.

- ``registry.py``: the types, their accepted ``optimizer.params`` (DeepSpeed's names and
  defaults), ``validate_optimizer`` (config -> ``OptimizerSpec``, once, when the config is parsed)
  and ``build_optimizer`` (spec + param groups -> ``torch.optim.Optimizer``).
- ``adam.py`` (Adam without bias correction), ``lion.py``, ``lamb.py``: the optimizers torch lacks.
- ``onebit.py`` (OneBitAdam, OneBitLamb), ``zero_one_adam.py`` (ZeroOneAdam): the 1-bit optimizers,
  exchanging their momentum through ``compression.py`` (sign + scale, error feedback) and the
  ZeRO strategy's ``zero.exchange.CompressedExchange``.
- ``muon.py``: Muon (orthogonalized momentum for hidden matrices, AdamW for the rest).
- ``chunks.py``: the base class those share (the step protocol over cache-sized batches of
  tensors, ``dslaunch.kernels.chunks``); their reference updates are ``dslaunch.kernels.reference``'s.
- ``torch_optimizers.py``: torch's optimizers, their update going through ``dslaunch.kernels``.

Importing this package does not import torch.
"""
