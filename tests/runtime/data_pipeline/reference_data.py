"""What the data-efficiency tests and their real-DeepSpeed reference (``ds_reference.py``) share: a
small token dataset, its metric functions and the curriculum configs. Torch and numpy only (it is
imported inside DeepSpeed's venv too)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

SAMPLES = 240
VOCAB = 16


def lengths() -> list[int]:
    """Sample i's token count: 1..48, scrambled."""
    return [1 + (i * 7919) % 48 for i in range(SAMPLES)]


class TokenDataset(torch.utils.data.Dataset):
    """Sample i: a dict with its tokens (padded to 48) and its length."""

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> Any:
        n = lengths()[i]
        tokens = torch.tensor([(i + 3 * k) % VOCAB for k in range(n)] + [0] * (48 - n), dtype=torch.long)
        return {"tokens": tokens, "length": torch.tensor(n), "index": torch.tensor(i)}


def collate(samples: list) -> list:
    return samples


def seqlen_metric(batch: list) -> torch.Tensor:
    return torch.tensor([int(s["length"]) for s in batch], dtype=torch.long)


def vocab_metric(batch: list) -> torch.Tensor:
    counts = torch.zeros(VOCAB, dtype=torch.long)
    for s in batch:
        counts += torch.bincount(s["tokens"][: int(s["length"])], minlength=VOCAB)
    return counts


def analyzer_kwargs(save_path: str, threads: int = 1, reduce: int = 1) -> dict:
    return {"num_workers": 1, "worker_id": 0, "num_threads": threads, "num_threads_reduce": reduce,
            "batch_size": 7, "metric_names": ["seqlen", "vocab"],
            "metric_functions": [seqlen_metric, vocab_metric],
            "metric_types": ["single_value_per_sample", "accumulate_value_over_samples"],
            "metric_dtypes": [torch.long, torch.long], "save_path": save_path, "collate_fn": collate}


def metric(analysis: str, kind: str, low: int, high: int, steps: int, step: int) -> dict:
    return {"index_to_sample_path": f"{analysis}/seqlen/seqlen_index_to_sample_percentile_merged"
            if kind == "percentile" else f"{analysis}/seqlen/seqlen_index_to_sample",
            "index_to_metric_path": f"{analysis}/seqlen/seqlen_index_to_metric", "difficulty_type": kind,
            "clustering_type": "schedule_based", "min_difficulty": low, "max_difficulty": high,
            "schedule_type": "fixed_linear", "schedule_config": {"total_curriculum_step": steps, "difficulty_step": step}}


def data_efficiency(analysis: str, clusters: str, case: str) -> dict:
    """The ``data_efficiency`` block of test case ``case`` (value, percentile, two metrics)."""
    metrics = {"value": {"seqlen": metric(analysis, "value", 8, 48, 12, 8)},
               "percentile": {"seqlen": metric(analysis, "percentile", 10, 100, 10, 10)},
               "both": {"seqlen": metric(analysis, "value", 16, 48, 6, 16),
                        "seqlenp": metric(analysis, "percentile", 30, 100, 8, 10)}}[case]
    return {"enabled": True, "seed": 4321, "data_sampling": {"enabled": True, "num_epochs": 2, "curriculum_learning": {
        "enabled": True, "data_cluster_path": clusters, "curriculum_metrics": metrics}}}


def indexed_items() -> list[np.ndarray]:
    return [np.arange(n, dtype=np.int64) * 3 - 7 for n in (5, 0, 1, 17, 3)]


LTD_SEED = 11


def ltd_block(layers: int = 4, dropping: tuple = (1, 2)) -> dict:
    """A ``random_ltd`` block (with the batch sizes DeepSpeed's engine adds)."""
    return {"enabled": True, "total_layer_num": layers, "random_ltd_layer_num": len(dropping),
            "random_ltd_layer_id": list(dropping), "model_mask_name": None, "model_type": "decoder",
            "hidden_state_order": "batch_seq_dim",
            "random_ltd_schedule": {"min_value": 4, "max_value": 12, "schedule_type": "fixed_linear",
                                    "schedule_config": {"require_steps": 10, "seq_per_step": 2}},
            "layer_token_lr_schedule": {"enabled": False}, "micro_batch_size": 2, "global_batch_size": 4}


def ltd_mask() -> torch.Tensor:
    """An encoder's attention mask [batch 2, 1, seq 6, seq 6] whose entries name their position."""
    return torch.arange(2 * 36, dtype=torch.float32).reshape(2, 1, 6, 6)


VARIABLE_CASES = {
    "dataloader": {"max_tokens": 100, "effective_batch_size": 4},
    "random": {"max_tokens": 120, "effective_batch_size": 3, "sequence_picking_order": "random", "seed": 9,
               "min_batch_size": 2, "max_batch_size": 5},
    "seqlen_same_size": {"max_tokens": 90, "effective_batch_size": 2, "sequence_picking_order": "seqlen",
                         "required_microbatches_of_same_size": True, "sequence_ids_per_mb": list(range(0, 240, 3))},
}
LR_CASES = {"linear_steplr": ("linear", True), "sqrt_constant": ("sqrt", False)}


def lr_run(vb: Any, method: str, use_scheduler: bool) -> dict:
    """8 steps of the LR scaled per batch, and rank 1's first 5 batches, from ``vb`` (DeepSpeed's
    ``variable_batch_size_and_lr`` module or dslaunch's: the same call on both sides)."""
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    base = torch.optim.lr_scheduler.StepLR(optimizer, 3, 0.5) if use_scheduler else optimizer
    loader, scheduler, _ = vb.get_dataloader_and_lr_scheduler_for_variable_batch_size(
        TokenDataset(), lengths(), 60, 4, lr_scaling_method=method, dataloader_batch_size=2,
        dataloader_rank=1, dataloader_num_replicas=2, dataloader_collate_fn=collate,
        lr_scheduler_or_optimizer=base, sequence_picking_order="random", seed=3)
    lrs = []
    for _ in range(8):
        optimizer.step()
        scheduler.step()
        lrs.append(scheduler.get_lr()[0])
    return {"lrs": lrs, "rank1": [[int(s["index"]) for s in b] for b in list(loader)[:5]]}
