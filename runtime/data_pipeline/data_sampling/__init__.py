"""``deepspeed.runtime.data_pipeline.data_sampling``: curriculum learning by data sampling.

``indexed_dataset.py`` (the memory-mapped indexed dataset format), ``data_analyzer.py`` (measures
every sample; its reduce in ``data_reduce.py``), ``data_sampler.py`` (DeepSpeed's
``DeepSpeedDataSampler``), ``curriculum_loader.py`` (the loader ``deepspeed_io`` returns with it),
``utils.py`` (shared helpers), ``variable_batch_size_and_lr.py`` (batches by a token budget, the LR
scaled to each).
"""
