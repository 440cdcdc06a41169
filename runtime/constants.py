"""``deepspeed.runtime.constants``: DeepSpeed's names of the ds_config's keys, and the defaults
its getters fall back to (DeepSpeed 0.19.8's, from ``config/deepspeed_defaults.py``), for scripts
and tests that build or read configs by these names."""

from dslaunch.runtime.config.deepspeed_defaults import DEEPSPEED_0_19_8

TRAIN_BATCH_SIZE = "train_batch_size"
TRAIN_MICRO_BATCH_SIZE_PER_GPU = "train_micro_batch_size_per_gpu"
GRADIENT_ACCUMULATION_STEPS = "gradient_accumulation_steps"
GRADIENT_ACCUMULATION_STEPS_DEFAULT = DEEPSPEED_0_19_8[GRADIENT_ACCUMULATION_STEPS]
MANAGED_GRADIENT_ACCUMULATION = "managed_gradient_accumulation"
MANAGED_GRADIENT_ACCUMULATION_DEFAULT = DEEPSPEED_0_19_8[MANAGED_GRADIENT_ACCUMULATION]
STEPS_PER_PRINT = "steps_per_print"
GRADIENT_CLIPPING = "gradient_clipping"
GRADIENT_CLIPPING_DEFAULT = DEEPSPEED_0_19_8[GRADIENT_CLIPPING]
PRESCALE_GRADIENTS = "prescale_gradients"
PRESCALE_GRADIENTS_DEFAULT = DEEPSPEED_0_19_8[PRESCALE_GRADIENTS]
GRADIENT_PREDIVIDE_FACTOR = "gradient_predivide_factor"
GRADIENT_PREDIVIDE_FACTOR_DEFAULT = DEEPSPEED_0_19_8[GRADIENT_PREDIVIDE_FACTOR]
DATALOADER_DROP_LAST = "dataloader_drop_last"
DATALOADER_DROP_LAST_DEFAULT = DEEPSPEED_0_19_8[DATALOADER_DROP_LAST]
LOG_LEVEL = "log_level"
LOG_LEVEL_DEFAULT = DEEPSPEED_0_19_8[LOG_LEVEL]
OPTIMIZER = "optimizer"
SCHEDULER = "scheduler"
TYPE = "type"
OPTIMIZER_PARAMS = "params"
SCHEDULER_PARAMS = "params"
FP16 = "fp16"
BFLOAT16 = "bf16"
ZERO_OPTIMIZATION = "zero_optimization"
# the pipeline engine's names of what a batch is for (PipelineEngine's ``_exec_schedule`` routes)
ROUTE_TRAIN = "train"
ROUTE_EVAL = "eval"
ROUTE_PREDICT = "predict"
ROUTE_ENCODE = "encode"
