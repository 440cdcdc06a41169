"""``deepspeed.checkpoint.reshape_utils``: a tag folder's files by kind, and ``merge_state``
(``dslaunch.runtime.checkpoint.deepspeed_reshape``)."""

from dslaunch.runtime.checkpoint.deepspeed_reshape import (
    basic_folder_validation,
    get_files,
    get_files_with_prefix,
    get_zero_files,
    merge_state,
    merge_state_dict,
    merge_state_list,
    partition_data,
    sort_zero_files,
    validate_files,
)

__all__ = ["basic_folder_validation", "get_files", "get_files_with_prefix", "get_zero_files", "merge_state",
           "merge_state_dict", "merge_state_list", "partition_data", "sort_zero_files", "validate_files"]
