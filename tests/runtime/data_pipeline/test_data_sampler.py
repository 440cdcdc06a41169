"""The curriculum sampler and its loader on dslaunch alone (DeepSpeed's batches are compared in
``test_deepspeed_reference.py``): each batch within the difficulty reached, exact resume from a
saved state (also one of DeepSpeed's shape), the loader's position with prefetching workers, and
one-line errors."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from dslaunch.errors import ConfigError, UsageError
from dslaunch.runtime.data_pipeline.data_sampling.data_analyzer import DataAnalyzer
from dslaunch.runtime.data_pipeline.data_sampling.data_sampler import DeepSpeedDataSampler
from dslaunch.runtime.dataloader import DeepSpeedDataLoader
from tests.runtime.data_pipeline import reference_data as ref


@pytest.fixture(scope="module")
def analysis(tmp_path_factory: pytest.TempPathFactory) -> str:
    out = str(tmp_path_factory.mktemp("analysis"))
    analyzer = DataAnalyzer(ref.TokenDataset(), **ref.analyzer_kwargs(out))
    analyzer.run_map()
    analyzer.run_reduce()
    return out


def _sampler(analysis: str, clusters: Path, case: str = "value", **change: object) -> DeepSpeedDataSampler:
    config = ref.data_efficiency(analysis, str(clusters), case)
    config["data_sampling"]["curriculum_learning"]["curriculum_metrics"]["seqlen"].update(change)
    return DeepSpeedDataSampler(config, ref.SAMPLES, 4, 0, 1, None, 2, 0)


@pytest.mark.timeout(60)
def test_batches_stay_within_the_difficulty_and_cover_more_as_it_rises(analysis: str, tmp_path: Path) -> None:
    sampler = _sampler(analysis, tmp_path)
    lengths, seen = ref.lengths(), set()
    it = iter(sampler)
    for micro in range(80):
        batch = next(it)
        step = micro // 2 + 1  # two micro batches per global batch
        limit = min(48, max(8, (8 + (48 - 8) * step // 12) // 8 * 8))
        assert len(batch) == 4 and max(lengths[i] for i in batch) <= limit, (micro, batch)
        seen.update(batch)
    assert sampler.current_difficulties == {"seqlen": 48} and len(seen) > 150


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case, k", [("value", 23), ("both", 23), ("value", 51)])
def test_resume_from_a_state_gives_the_uninterrupted_batches(analysis: str, tmp_path: Path, case: str, k: int) -> None:
    """At 23 micro batches 6 (8) clusters exist and none was used up yet; by 51 some were
    reshuffled; more are made and reshuffled in the 40 batches after."""
    first = _sampler(analysis, tmp_path / "run", case)
    it = iter(first)
    before = [next(it) for _ in range(k)]  # k odd: mid global batch
    state = first.state_dict()
    shutil.copytree(tmp_path / "run", tmp_path / "saved")  # the files as a job that stopped here left them
    after = [next(it) for _ in range(40)]
    second = _sampler(analysis, tmp_path / "saved", case)
    second.load_state_dict(state)
    assert [b for b, _ in zip(iter(second), range(40), strict=False)] == after
    assert before and state["consumed_samples"] == k * 4


@pytest.mark.timeout(60)
def test_a_deepspeed_state_loads_as_deepspeed_loads_it(analysis: str, tmp_path: Path) -> None:
    sampler = _sampler(analysis, tmp_path)
    it = iter(sampler)
    [next(it) for _ in range(5)]
    state = {**sampler.state_dict(), "np_rng_state": np.random.RandomState(7).get_state(),
             "data_cluster_paths": [f"/elsewhere/{p}" for p in sampler.data_cluster_paths]}
    fresh = _sampler(analysis, tmp_path)
    fresh.load_state_dict(state)  # numpy's global state, absolute paths: DeepSpeed's older checkpoints
    assert np.random.get_state()[1][0] == np.random.RandomState(7).get_state()[1][0]
    assert fresh.data_cluster_paths == sampler.data_cluster_paths and len(next(iter(fresh))) == 4


@pytest.mark.timeout(90)
def test_loader_position_ignores_prefetching_and_post_processes(analysis: str, tmp_path: Path) -> None:
    config = ref.data_efficiency(analysis, str(tmp_path / "c"), "value")

    def loader(workers: int, where: str) -> object:
        block = {**config, "data_sampling": {**config["data_sampling"], "curriculum_learning": {
            **config["data_sampling"]["curriculum_learning"], "data_cluster_path": str(tmp_path / where)}}}
        return DeepSpeedDataLoader(ref.TokenDataset(), 4, False, 0, None, collate_fn=ref.collate,
                                   data_parallel_world_size=1, data_parallel_rank=0, deepspeed_dataloader_config={
                                       "curriculum_learning": True, "data_efficiency": block, "num_workers": workers,
                                       "gradient_accumulation_steps": 2, "global_rank": 0})

    plain, prefetching = loader(0, "a"), loader(2, "b")
    plain.post_process_func = lambda batch, state: (batch, state["curriculum_step"])
    got = [next(plain) for _ in range(7)]
    fetched = [next(prefetching) for _ in range(7)]
    assert [[int(s["index"]) for s in b] for b, _ in got] == [[int(s["index"]) for s in b] for b in fetched]
    assert [step for _, step in got] == [1, 1, 2, 2, 3, 3, 4]
    assert prefetching.state_dict() == plain.state_dict()  # not the 2 workers' batches ahead
    assert type(plain).__name__ == "CurriculumDataLoader" and len(plain) == ref.SAMPLES * 2 // 4


@pytest.mark.timeout(30)
def test_errors_are_one_line(analysis: str, tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=r"no sample qualifies at step 1 \(difficulty seqlen 0\)"):
        next(iter(_sampler(analysis, tmp_path, min_difficulty=0, schedule_type="fixed_discrete",
                           schedule_config={"difficulty": [0, 48], "max_step": [3]})))
    with pytest.raises(ConfigError, match="curriculum_metrics.seqlen.schedule_config.difficulty_step"):
        _sampler(analysis, tmp_path, schedule_config={"total_curriculum_step": 3})
    with pytest.raises(ConfigError, match="max_difficulty': 120 is above 100"):
        _sampler(analysis, tmp_path, "percentile", max_difficulty=120)
