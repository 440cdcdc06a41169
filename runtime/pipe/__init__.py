"""Pipeline parallelism (DeepSpeed's ``deepspeed.runtime.pipe``, also ``deepspeed.pipe``).

``module.py``: ``PipelineModule`` and ``LayerSpec``/``TiedLayerSpec``, a model cut into stages;
``placement.py``: which rank holds which part of the model (round-robin, or DualPipeV's V);
``schedule.py``: the instruction streams of each stage (DeepSpeed's 1F1B ``TrainSchedule``, the
interleaved and inference schedules), ``vschedule.py`` DualPipeV's; ``engine.py``:
``PipelineEngine``, which runs them (``train_batch``/``eval_batch``), ``checks.py`` the
configurations it refuses, ``data.py`` what it does to the tensors it moves; ``p2p.py``:
activations and gradients between stages; ``dualpipev.py``: ``DualPipeVModule`` and
``DualPipeVEngine`` (DeepSpeed 0.19.8's DualPipeV); ``topology.py``: DeepSpeed's path of the rank
topology (``dslaunch.runtime.parallel``).
"""
