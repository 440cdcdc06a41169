"""``HybridEngineRollout`` on a tiny Hugging Face Llama (``scripts/rollout_llama.py``) under the hybrid
engine at ZeRO-0 and ZeRO-3, 2 gloo ranks with different prompts: greedy rollouts are the weights'
own ``generate`` (stopping at EOS, padded after it), masks and response targets line up, top-k 1 and
a vanishing top-p sample greedily, and an on-policy distillation loop (rollout, JSD on the responses,
``engine.backward``, ``engine.step``) moves the weights and lowers the loss."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dslaunch.utils.ports import free_port
from tests.compat.conftest import run_job

SCRIPT = Path(__file__).resolve().parent / "scripts" / "rollout_llama.py"
PAD, PROMPT, NEW = 0, 5, 6


def _reports(out: str) -> list[dict]:
    found = {}
    for line in out.splitlines():
        for rank in (0, 1):
            if line.startswith(f"[rank{rank}] ROLLOUT "):
                found[rank] = json.loads(line.split("ROLLOUT ", 1)[1])
    assert sorted(found) == [0, 1], out[-3000:]
    return [found[0], found[1]]


def _check_greedy(report: dict) -> None:
    greedy, want, eos = report["greedy"], report["reference"], report["eos"]
    ids, mask = greedy["input_ids"], greedy["attention_mask"]
    assert greedy["response_start_idx"] == [PROMPT, PROMPT] and greedy["mask_dtype"] == "torch.int64"
    for row, ref in zip(ids, want, strict=True):
        # the model's own generate stops once every row has its EOS; the rollout always has NEW columns
        assert len(row) == PROMPT + NEW and row[:len(ref)] == ref
        assert all(tok == PAD for tok in row[len(ref):])
    for row, row_mask, prompt_mask in zip(ids, mask, report["prompt_mask"], strict=True):
        assert row_mask[:PROMPT] == prompt_mask
        response = row[PROMPT:]
        end = response.index(eos) + 1 if eos in response else NEW
        assert all(tok == PAD for tok in response[end:])
        assert row_mask[PROMPT:] == [1] * end + [0] * (NEW - end)  # the EOS itself counts
    assert eos in ids[0][PROMPT:PROMPT + 3]  # the EOS was chosen from row 0's response: stopping is exercised
    # response-only causal targets: the logits at column i predict token i + 1 where it is a real response token
    assert greedy["target_ids"] == [row[1:] for row in ids]
    assert greedy["response_mask"] == [[i + 1 >= PROMPT and bool(m[i + 1]) for i in range(len(m) - 1)] for m in mask]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [0, 3])
def test_rollouts_and_an_on_policy_loop_on_a_hugging_face_llama(compat_bin: Path, tmp_path: Path, stage: int) -> None:
    out = run_job([str(compat_bin / "dslaunch"), "--num_gpus", "2", "--master_port", str(free_port()),
                   str(SCRIPT), str(stage)], cwd=tmp_path, timeout=110)
    reports = _reports(out)
    assert reports[0]["greedy"]["input_ids"] != reports[1]["greedy"]["input_ids"]  # each rank its own prompts
    for report in reports:
        assert report["engine"] == "DeepSpeedHybridEngine"
        _check_greedy(report)
        greedy_rows = report["greedy"]["input_ids"]
        for name in ("top_k1", "top_p0"):  # 2 samples a prompt, each greedy's tokens (up to its EOS padding)
            rows = report[name]
            assert len(rows) == 4
            for i, row in enumerate(rows):
                want = greedy_rows[i // 2]
                assert row == want, (name, i)
        assert report["sampled"] == {"shape": [6, PROMPT + NEW], "low": report["sampled"]["low"],
                                     "high": report["sampled"]["high"]}
        assert 0 <= report["sampled"]["low"] and report["sampled"]["high"] < 40
        profile = report["profile"]  # the model's own generate: one prefill forward, then one per new token
        assert (profile["num_decode_forwards"], profile["response_length"]) == (NEW - 1, NEW)
        assert 0 < profile["prefill_forward_ms"] and 0 < profile["decode_forward_ms"] < profile["generation_ms"]
        losses = report["losses"]
        assert report["moved"] > 1e-4 and losses[-1] < losses[0], (report["moved"], losses)
