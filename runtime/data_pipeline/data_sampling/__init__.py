"""``deepspeed.runtime.data_pipeline.data_sampling``: difficulty-based sampling, refused on use
(``data_analyzer.py``, ``indexed_dataset.py``, ``variable_batch_size_and_lr.py``).
"""
