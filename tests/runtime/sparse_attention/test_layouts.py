"""The sparsity layouts equal DeepSpeed's, element for element, random blocks included.

``deepspeed_layouts.json`` holds the layouts DeepSpeed's own ``sparsity_config.py`` (0.19.6 tree,
the last with sparse attention) drew for every case of ``deepspeed_layouts.CASES``; a second test
reruns DeepSpeed's code where its source and venv are on this machine
(``DSLAUNCH_DEEPSPEED_SPARSITY_CONFIG``, default ``/work/ds-src/...``), so the fixture cannot go
stale unnoticed.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch

import dslaunch.ops.sparse_attention as facade
from dslaunch.errors import SparsityConfigError
from dslaunch.runtime.sparse_attention import layouts
from tests.deepspeed_reference import run_python
from tests.runtime.sparse_attention import deepspeed_layouts

HERE = Path(__file__).resolve().parent
FIXTURE = HERE / "deepspeed_layouts.json"
DS_SOURCE = Path(os.environ.get("DSLAUNCH_DEEPSPEED_SPARSITY_CONFIG",
                                "/work/ds-src/deepspeed/ops/sparse_attention/sparsity_config.py"))


@pytest.mark.timeout(60)
def test_every_layout_equals_deepspeeds_fixture() -> None:
    want = json.loads(FIXTURE.read_text())
    got = deepspeed_layouts.layouts(layouts)
    assert len(want) == len(deepspeed_layouts.CASES) == len(got)
    differ = [key for key in want if want[key] != got[key]]
    assert not differ, differ


@pytest.mark.timeout(120)
def test_the_fixture_is_what_deepspeeds_code_draws_now(deepspeed_python: Path, tmp_path: Path) -> None:
    if not DS_SOURCE.exists():
        pytest.skip(f"DeepSpeed's sparsity_config.py ({DS_SOURCE}) is not here: set DSLAUNCH_DEEPSPEED_SPARSITY_CONFIG")
    out = tmp_path / "layouts.json"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": ""}
    done = run_python(deepspeed_python, [deepspeed_layouts.__file__, str(DS_SOURCE), str(out)], env, timeout=100)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert json.loads(out.read_text()) == json.loads(FIXTURE.read_text())


@pytest.mark.timeout(30)
def test_layouts_are_int64_and_random_ones_follow_pythons_random_state() -> None:
    cfg = layouts.BigBirdSparsityConfig(num_heads=2, num_random_blocks=2)
    random.seed(3)
    first = cfg.make_layout(256)
    random.seed(3)
    assert first.dtype == torch.int64 and torch.equal(first, cfg.make_layout(256))
    assert torch.equal(first[0], first[1])  # one layout for all heads unless asked otherwise
    assert not torch.equal(first, cfg.make_layout(256))  # the next draw differs (random state moved on)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("build, seq_len, words", [
    (lambda: layouts.FixedSparsityConfig(4), 100, "not a multiple of the block size 16"),
    (lambda: layouts.FixedSparsityConfig(4, num_local_blocks=3, num_global_blocks=2), 64, "num_local_blocks=3"),
    (lambda: layouts.FixedSparsityConfig(4, attention="causal"), 64, "attention='causal'"),
    (lambda: layouts.FixedSparsityConfig(4, attention="unidirectional", horizontal_global_attention=True), 64,
     "needs attention='bidirectional'"),
    (lambda: layouts.FixedSparsityConfig(4, num_different_global_patterns=2), 64, "different_layout_per_head"),
    (lambda: layouts.VariableSparsityConfig(4, global_block_indices=[0, 2], global_block_end_indices=[1]), 64,
     "one end per start"),
    (lambda: layouts.VariableSparsityConfig(4, global_block_indices=[3], global_block_end_indices=[3]), 64,
     "[3, 3)"),
    (lambda: layouts.BigBirdSparsityConfig(4, num_random_blocks=5), 64, "num_random_blocks=5"),
    (lambda: layouts.BigBirdSparsityConfig(4, num_random_blocks=2, attention="unidirectional"), 64,
     "earlier blocks of row 0"),
    (lambda: layouts.BSLongformerSparsityConfig(4, num_sliding_window_blocks=7), 64, "num_sliding_window_blocks=7"),
    (lambda: layouts.SparsityConfig(4), 64, "has no layout of its own"),
])
def test_bad_arguments_fail_in_one_line_as_deepspeeds_exception_types(build, seq_len: int, words: str) -> None:
    with pytest.raises(SparsityConfigError) as info:
        build().make_layout(seq_len)
    assert words in str(info.value) and "\n" not in str(info.value)
    assert isinstance(info.value, ValueError) and isinstance(info.value, NotImplementedError)


@pytest.mark.timeout(30)
def test_deepspeed_paths_name_the_same_classes() -> None:
    # DeepSpeed's tests skip unless the op table says sparse attention runs here: it does, anywhere
    from dslaunch import ops
    from dslaunch.ops.op_builder import SparseAttnBuilder
    from dslaunch.ops.sparse_attention import sparsity_config

    assert SparseAttnBuilder.NAME == "sparse_attn" and ops.__compatible_ops__["sparse_attn"]

    for name in layouts.__all__:
        assert getattr(facade, name) is getattr(layouts, name) is getattr(sparsity_config, name)
