"""``deepspeed.runtime.data_pipeline.data_sampling``: difficulty-based sampling, refused on use."""
