"""Inference: ``init_inference`` shards a model over a tensor-parallel group and serves
``forward`` / ``generate`` (DeepSpeed's ``deepspeed.inference`` re-exports it).

``config.py`` (the ``init_inference`` config as frozen dataclasses), ``engine.py``
(``InferenceEngine``: plan, load, shard, check inputs), ``loading.py`` (meta-device models and
checkpoint sources read shard by shard), ``kernel_inject.py`` (fused kernels in place of modules,
after a probe), ``shm_allreduce.py`` (the one-host shared-memory all-reduce). AutoTP's planner
and layers are shared with training: ``dslaunch.runtime.tensor_parallel``.
"""
