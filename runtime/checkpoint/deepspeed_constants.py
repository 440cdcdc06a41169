"""The key and file-name strings of DeepSpeed 0.19.8's checkpoints (``deepspeed.checkpoint.constants``).

Every name DeepSpeed's module has, with its value: they are the format itself (the keys inside
``*_model_states.pt`` / ``*_optim_states.pt``, the file-name parts, the keys of a model's
``universal_checkpoint_info``), so a script that builds or reads such files by these names gets the
same strings from dslaunch. The AutoEP and folding keys are listed for scripts that read such
checkpoints' metadata; dslaunch writes AutoEP tags' ``ds_autoep_layers`` (``deepspeed_autoep``),
not the folding keys.
"""

from __future__ import annotations

# --- inside a ZeRO optimizer-states file (``optimizer_state_dict``) ---
OPTIMIZER_STATE_DICT = "optimizer_state_dict"
FP32_GROUPS = "fp32_groups"
FP32_FLAT_GROUPS = "fp32_flat_groups"
BASE_OPTIMIZER_STATE = "base_optimizer_state"
BASE_OPTIMIZER_STATE_STEP = "base_optimizer_state_step"
SINGLE_PARTITION_OF_FP32_GROUPS = "single_partition_of_fp32_groups"
PARAM_GROUPS = "param_groups"
GROUP_PADDINGS = "group_paddings"
PARAM_ALIGNMENT_PADDINGS = "param_alignment_paddings"
PARTITION_COUNT = "partition_count"
ZERO_STAGE = "zero_stage"
CLIP_GRAD = "clip_grad"
FP32_WEIGHT_KEY = "fp32"
LOSS_SCALER = "loss_scaler"

# --- inside a model-states file ---
PARAM = "param"
PARAM_SHAPES = "param_shapes"
BUFFER_NAMES = "buffer_names"
FROZEN_PARAM_SHAPES = "frozen_param_shapes"
FROZEN_PARAM_FRAGMENTS = "frozen_param_fragments"
DS_VERSION = "ds_version"
CHECKPOINT_PARALLEL_DIMS = "checkpoint_parallel_dimensions"
CHECKPOINT_PP_DEGREE = "pp_degree"
CHECKPOINT_TP_DEGREE = "tp_degree"

# --- file names: mp_rank_XX_model_states.pt, [bf16_|fp16_]zero_pp_rank_D_mp_rank_XX_optim_states.pt,
# layer_XX-model_states.pt ---
MODEL_FILE_PREFIX = "mp_rank_"
ZERO_FILE_PREFIX = "zero_pp_rank_"
OPTIM_FILE_SUFFIX = "_optim_states.pt"
MODEL_FILE_SUFFIX = "_model_states.pt"
LAYER_FILE_PREFIX = "layer_"
BF16_ZERO_FILE_PREFIX = "bf16_" + ZERO_FILE_PREFIX
FP16_ZERO_FILE_PREFIX = "fp16_" + ZERO_FILE_PREFIX

# --- universal checkpoints: a model's ``universal_checkpoint_info`` and the converted files ---
UNIVERSAL_CHECKPOINT_INFO = "universal_checkpoint_info"
UNIVERSAL_CHECKPOINT_VERSION_KEY = "universal_checkpoint_version"
UNIVERSAL_CHECKPOINT_VERSION_VALUE = 0.4  # the layout version DeepSpeed 0.19.8 writes
DS_AUTOTP_UC_META = "ds_autotp_universal_checkpoint_meta"
AUTOTP_UNSUPPORTED_PARAMETER_PATTERNS = "autotp_unsupported_parameter_patterns"
AFFINE_MAP = "affine_map"
AFFINE_MAP_VERSION = "version"
AFFINE_MAP_PARAMS = "params"
VOCAB_TENSOR = "vocab_tensor"
PADDED_VOCAB_SIZE = "padded_vocab_size"
ORIGINAL_VOCAB_SIZE = "original_vocab_size"
PARAM_SLICE_MAPPINGS = "param_slice_mappings"
CAT_DIM = "cat_dim"
PARAM_N_SUB_PARAMS = "param_n_sub_params"
SUB_PARAM_SHAPE = "sub_param_shape"
# regex lists naming parameters the converter treats specially
VOCABULARY_PARAMETER_PATTERNS = "vocabulary_parameter_patterns"
PIPELINE_REPLICATED_PARAMETER_PATTERNS = "pipeline_replicated_parameter_patterns"
PARAMETER_TO_AVERAGE_PATTERNS = "parameter_to_average_patterns"
PARAMETER_WITH_ROW_PARALLELISM_PATTERNS = "parameter_with_row_parallelism_patterns"
TP_REPLICATED_PARAMETER_PATTERNS = "tp_replicated_parameter_patterns"
PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0 = "parameter_with_2_sub_params_cat_dim_0"
PARAMETER_WITH_SUB_PARAMS = "parameter_with_sub_params"
SUB_PARAM_SHARD_WIDTHS = "sub_param_shard_widths"
SUB_PARAMS_SHAPE = "sub_params_shape"

# --- AutoEP (expert parallelism by module replacement) metadata ---
AUTOEP_LAYERS_KEY = "ds_autoep_layers"
AUTOEP_LAYERS_KEY_LEGACY = "autoep_layers"
AUTOEP_EXPERT_KEY_PREFIX = "expert_key_prefix"
AUTOEP_NUM_EXPERTS = "num_experts"
AUTOEP_NUM_LOCAL_EXPERTS = "num_local_experts"
AUTOEP_EP_SIZE = "ep_size"
AUTOEP_EXPERT_PLACEMENT = "expert_placement"
AUTOEP_AFFINE_MAPS = "affine_maps"
DS_AUTOEP_UC_META = "ds_autoep_uc_meta"
AUTOEP_PARAM_LOGICAL_SHAPE = "logical_shape"
AUTOEP_PARAM_EP_RANK = "ep_rank"
AUTOEP_PARAM_LOCAL_EXPERTS = "local_experts"
AUTOEP_ZERO12_REQUIRED_FIELDS = (AUTOEP_EXPERT_KEY_PREFIX, AUTOEP_NUM_EXPERTS, AUTOEP_NUM_LOCAL_EXPERTS,
                                 AUTOEP_EP_SIZE)
AUTOEP_ZERO3_EXPERT_STATE_FORMAT_KEY = "checkpoint_format"
AUTOEP_ZERO3_PARTITIONED_EXPERT_STATE_FORMAT = "zero3_partitioned"
AUTOEP_ZERO3_EXPERT_STATE_FORMAT_VERSION_KEY = "checkpoint_format_version"
AUTOEP_ZERO3_EXPERT_STATE_FORMAT_VERSION = 1
AUTOEP_PLACEMENT_VERSION_KEY = "version"
AUTOEP_PLACEMENT_VERSION = 1
AUTOEP_PLACEMENT_NUM_EXPERTS = "num_experts"
AUTOEP_PLACEMENT_EP_SIZE = "ep_size"
AUTOEP_PLACEMENT_RANKS = "ranks"
AUTOEP_PLACEMENT_RANK = "rank"
AUTOEP_PLACEMENT_EXPERTS = "experts"
EP_IS_EXPERT_PARAM = "is_expert_param"
EP_NUM_EXPERTS = "ep_num_experts"
EXPERT_PARAMETER_PATTERNS = "expert_parameter_patterns"

# --- AutoEP + AutoTP folding metadata ---
FOLDING_METADATA_KEY = "folding"
FOLDING_METADATA_VERSION = 1
FOLDING_TP_SIZE = "tp_size"
FOLDING_TP_RANK = "tp_rank"
FOLDING_EP_SIZE = "ep_size"
FOLDING_EP_RANK = "ep_rank"
FOLDING_ETP_SIZE = "etp_size"
FOLDING_ETP_RANK = "etp_rank"
FOLDING_ZERO_PARTITION_GROUP = "zero_partition_group"
FOLDING_ZERO_PARTITION_RANK = "zero_partition_rank"
FOLDING_ZERO_PARTITION_COUNT = "zero_partition_count"
FOLDING_DISPATCH_STRATEGY = "dispatch_strategy"
FOLDING_SHARED_EXPERT_PLACEMENT = "shared_expert_placement"
FOLDING_FAMILY = "family"
FOLDING_PARAM_FAMILIES = "param_families"

__all__ = sorted(name for name in dir() if name.isupper())
