"""``deepspeed.runtime.sequence_parallel``: Ulysses sequence parallelism for Hugging Face models
(ALST), refused on use (``ulysses_sp``)."""
