"""``dslaunch --autotuning``: search ZeRO stage, offload, activation checkpointing and batch sizes.

- ``space.py``: the candidates and the ds_config each one makes;
- ``tuners.py``: the search strategies (``tuner_type``): which candidate next;
- ``estimate.py``: the memory estimator's seam and the limit it prunes against;
- ``experiments.py``: one experiment, launched by dslaunch itself, measured, killed when it fails,
  hangs or times out;
- ``search.py``: the rules every tuner shares (pruning, stopping);
- ``tune.py``: the pipeline and the results written out.

The engine's side (the measurement inside an experiment) is ``dslaunch.runtime.autotuning``.
"""
