"""Pipeline parallelism (DeepSpeed's ``deepspeed.runtime.pipe``, also ``deepspeed.pipe``).

``module.py``: ``PipelineModule`` and ``LayerSpec``/``TiedLayerSpec``, a model cut into stages;
``schedule.py``: the instruction streams of each stage (DeepSpeed's 1F1B ``TrainSchedule``);
``engine.py``: ``PipelineEngine``, which runs them (``train_batch``/``eval_batch``), ``data.py`` what
it does to the tensors it moves; ``p2p.py``:
activations and gradients between neighbouring stages; ``topology.py``: DeepSpeed's path of the
rank topology (``dslaunch.runtime.parallel``); ``dualpipev.py``: DeepSpeed's DualPipeV names, refused
on use.
"""
