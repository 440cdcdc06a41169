"""``dslaunch estimate``: the table sorted by what fits, JSON for tools, DeepSpeed's tables on
request, and one error line (naming the option) for bad input."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from dslaunch.launcher import cli
from dslaunch.launcher.cli.estimate import parse_bytes, parse_count

pytestmark = pytest.mark.timeout(60)

LLAMA = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "intermediate_size": 11008,
         "vocab_size": 32000, "hidden_act": "silu", "tie_word_embeddings": False}


def _estimate(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(["estimate", *args])
    return code, out.getvalue(), err.getvalue()


def test_sizes_and_counts() -> None:
    assert parse_bytes("--gpu_memory", "80GB") == parse_bytes("--gpu_memory", "80 GiB") == 80 * 2**30
    assert parse_bytes("--gpu_memory", "24576MB") == 24 * 2**30
    assert parse_count("--params", "7B") == parse_count("--params", "7e9") == 7_000_000_000
    assert parse_count("--params", "1.3B") == 1_300_000_000 and parse_count("--params", "350K") == 350_000


def test_table_puts_what_fits_first(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    code, out, err = _estimate("--hf_config", str(tmp_path / "config.json"), "--num_gpus", "8", "--seq_len", "4096",
                               "--micro_batch", "2", "--gpu_memory", "40GB", "--offload", "none,cpu",
                               "--flash_attention")
    assert code == 0, err
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    fits = [r[-1] for r in rows]
    assert set(fits) == {"yes", "ckpt", "no"}
    assert fits == sorted(fits, key=["yes", "ckpt", "no"].index)  # grouped in that order
    assert rows[-1][:3] == ["0", "none", "none"]  # stage 0 holds 20 bytes per parameter: 125 GiB
    assert len(rows) == 1 + 2 + 2 + 3  # stage 0; 1 and 2 with/without offload; 3 with 3 combinations
    assert "hidden 4096, 32 layers" in out and "fits 40.00GiB" in out


def test_json_rows_carry_bytes_by_purpose() -> None:
    code, out, _ = _estimate("--params", "1B", "--largest_layer", "50M", "--num_gpus", "4", "--precision",
                             "fp32,bf16", "--stages", "3", "--offload", "none", "--json", "--gpu_memory", "16GB")
    assert code == 0
    doc = json.loads(out)
    assert doc["model"]["params"] == 1_000_000_000 and doc["gpu_memory"] == 16 * 2**30
    assert {r["setup"]["precision"] for r in doc["rows"]} == {"fp32", "bf16"}
    row = next(r for r in doc["rows"] if r["setup"]["precision"] == "bf16")
    assert row["plain"]["device"]["optimizer_state"] == 8 * 10**9 // 4  # Adam's 8 bytes, a quarter each
    assert row["activations_known"] is False and row["fits"] in ("yes", "no")


def test_cpu_ranks_add_what_dev_shm_must_hold() -> None:
    args = ("--params", "100M", "--largest_layer", "10M", "--num_gpus", "4", "--stages", "1", "--offload", "none",
            "--precision", "fp32")
    code, out, err = _estimate(*args, "--accelerator", "cpu")
    assert code == 0, err
    assert "node /dev/shm" in out and "--shm-size" in out
    (row,) = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    # 4 ranks' gradients and flat weights (400 MB each) and two transports' slots (2 x 4 x 8 MiB)
    assert row[-1] == f"{(2 * 4 * 4 * 10**8 + 2 * 64 * 2**20) / 2**30:.2f}"
    doc = json.loads(_estimate(*args, "--accelerator", "cpu", "--json")[1])
    assert doc["rows"][0]["plain"]["shm_bytes"] == 2 * 4 * 4 * 10**8 + 2 * 64 * 2**20
    gpu = _estimate(*args)[1]
    assert "/dev/shm" not in gpu  # a GPU's tensors never go through /dev/shm


def test_deepspeed_config_knobs_hold_in_every_row(tmp_path) -> None:
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_batch_size": 32, "gradient_accumulation_steps": 2,
                               "optimizer": {"type": "Lion", "params": {"lr": 1e-4}}, "fp16": {"enabled": True},
                               "zero_optimization": {"stage": 1, "reduce_bucket_size": 1e6}}))
    code, out, err = _estimate("--params", "1B", "--num_gpus", "4", "--deepspeed_config", str(cfg), "--json")
    assert code == 0, err
    rows = json.loads(out)["rows"]
    assert {r["setup"]["stage"] for r in rows} == {0, 1, 2, 3}  # the sweep still varies the stage
    assert all(r["setup"]["optimizer"] == "lion" and r["setup"]["micro_batch"] == 4 for r in rows)
    assert {r["setup"]["precision"] for r in rows} == {"fp16"}
    assert all(r["setup"]["reduce_bucket_size"] == 1_000_000 for r in rows)
    code, _, err = _estimate("--params", "1B", "--deepspeed_config", str(tmp_path / "nope.json"))
    assert code != 0 and "nope.json" in err and err.count("\n") == 1


def test_deepspeed_mode_prints_deepspeeds_tables() -> None:
    code, out, _ = _estimate("--params", "13B", "--largest_layer", "325M", "--num_gpus", "8", "--deepspeed")
    assert code == 0
    assert "  581.15GB |  51.46GB | offload_optimizer=none" in out  # DeepSpeed 0.19.8's ZeRO-2 row
    assert "   14.53GB |  28.45GB | offload_param=none, offload_optimizer=none, zero_init=1" in out


@pytest.mark.parametrize("args, message", [
    ((), "give the model as exactly one of --params"),
    (("--params", "7B", "--model", "a:b"), "(got --params, --model)"),
    (("--params", "lots"), "--params: 'lots' is not a count"),
    (("--params", "1B", "--largest_layer", "2B"), "--largest_layer: 2B exceeds --params 1B"),
    (("--params", "1B", "--gpu_memory", "80 furlongs"), "--gpu_memory: '80 furlongs' is not a size"),
    (("--params", "1B", "--precision", "fp8"), "--precision: 'fp8'; valid: a comma list of fp32, bf16, fp16"),
    (("--params", "1B", "--stages", "4"), "--stages: '4'"),
    (("--params", "1B", "--num_gpus", "8", "--pipeline", "3"), "must divide the world size 8"),
    (("--params", "1B", "--optimizer", "adamx"), "optimizer: got 'adamx'; valid: adam"),
    (("--hf_config", "/nonexistent/config.json"), "--hf_config /nonexistent/config.json: cannot read: No such file"),
    (("--params", "1B", "--num_gpus", "0"), "--num_gpus"),
])
def test_bad_input_is_one_line(args, message) -> None:
    code, out, err = _estimate(*args)
    assert code != 0 and out == ""
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_layers_without_attention_hold_the_mlp_half() -> None:
    args = ("--params", "10M", "--hidden", "256", "--layers", "4", "--seq_len", "128", "--micro_batch", "8",
            "--stages", "0", "--precision", "fp32", "--json")
    rows = [json.loads(_estimate(*args, *extra)[1])["rows"][0] for extra in ((), ("--no_attention",))]
    with_attn, mlp = (r["plain"]["device"]["activations"] for r in rows)
    tokens, h = 8 * 128, 256
    # 4 layers of: norm in and out (4 bytes each), a dropout mask, the FFN's two 4h-wide tensors;
    # then backward's gradient of a 4h-wide activation (no vocabulary, no parameter sizes given)
    assert mlp == tokens * h * (4 * (9 + 2 * 4 * 4) + 4 * 4) and mlp < with_attn


def test_expert_parallel_size_spreads_the_experts() -> None:
    args = ("--params", "10B", "--expert_params", "8B", "--num_experts", "8", "--num_gpus", "8", "--stages", "1",
            "--precision", "bf16", "--offload", "none", "--json")
    code, out, err = _estimate(*args, "--expert_parallel_size", "4")
    assert code == 0, err
    (row,) = json.loads(out)["rows"]
    assert row["setup"]["expert_parallel"] == 4
    assert row["plain"]["device"]["optimizer_state"] == (2 * 10**9 // 8 + 2 * 10**9 // 2) * 8  # hand count
    code, out, err = _estimate(*args[:-1], "--expert_parallel_size", "4")
    assert code == 0 and "8,000.0M in 8 experts a layer" in out and "expert parallel 4" in out, out
    code, _, err = _estimate("--hf_config", "x.json", "--num_experts", "8")
    assert code != 0 and "--expert_params/--num_experts: only with --params" in err, err
