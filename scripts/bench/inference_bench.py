"""Tensor-parallel inference: per-token latency and tokens/s of greedy decoding at tp=1 and tp=2
on one ~134M-parameter Llama (fp32, batch 1, 16-token prompt, 32 new tokens), each rank bound to
its own core: dslaunch over gloo and over its shared-memory all-reduce, and DeepSpeed 0.19.8's
``init_inference`` AutoTP, in the same run. Target: dslaunch tp=2 <= 0.7x of tp=1 per token.

Needs ``.venv-compat`` (dslaunch + transformers) and a DeepSpeed venv (default /tmp/venv-ds-inf:
torch 2.13.0, transformers 5.23.0, ``pip install --no-build-isolation deepspeed==0.19.8``); run it
under ``flock /tmp/dslaunch-bench.lock``. Writes results/inference_bench.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from dslaunch.utils.ports import free_port

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
RESULTS = HERE / "results"
WORKER = HERE / "inference_worker.py"
MODEL = dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
             num_key_value_heads=12, max_position_embeddings=256, tie_word_embeddings=False)


def make_model(compat_python: Path, model_dir: Path) -> None:
    if (model_dir / "model.safetensors").exists():
        return
    code = ("import sys, torch, transformers as T; torch.manual_seed(0); "
            f"c = T.LlamaConfig(**{MODEL!r}); m = T.LlamaForCausalLM(c); "
            "m.save_pretrained(sys.argv[1], safe_serialization=True)")
    subprocess.run([str(compat_python), "-c", code, str(model_dir)], check=True)


PORT = "{port}"  # replaced by a free port at each run: the machine's other jobs may hold 29500


def run(cmd: list[str], env: dict[str, str]) -> dict:
    if not Path(cmd[0]).exists():
        return {"error": f"{cmd[0]} not found"}
    cmd = [str(free_port()) if arg == PORT else arg for arg in cmd]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "RESULT {" in ln]
    if proc.returncode != 0 or not lines:
        return {"error": (proc.stdout + proc.stderr)[-1500:]}
    return json.loads(lines[-1].split("RESULT ", 1)[1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ds-venv", default="/tmp/venv-ds-inf")
    parser.add_argument("--model-dir", default="/tmp/dslaunch-inference-bench-model")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    compat = ROOT / ".venv-compat" / "bin"
    ds = Path(args.ds_venv) / "bin"
    model_dir = Path(args.model_dir)
    if not (compat / "python").exists():
        print("inference_bench: needs .venv-compat (make compat-venv) for transformers; skipped")
        return
    if not (ds / "python").exists():
        print(f"inference_bench: no DeepSpeed venv at {args.ds_venv}: its rows will say so")
    make_model(compat / "python", model_dir)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "DS_ACCELERATOR": "cpu",
           "TORCH_EXTENSIONS_DIR": "/tmp/dslaunch-inference-bench-ext"}
    worker = [str(WORKER)]
    dslaunch2 = [str(compat / "dslaunch"), "--num_gpus", "2", "--master_port"]  # + a free port per run
    cases = {
        "dslaunch tp=1": [str(compat / "python"), *worker, "dslaunch", str(model_dir), "auto"],
        "dslaunch tp=2 gloo": [*dslaunch2, PORT, *worker, "dslaunch", str(model_dir), "torch"],
        "dslaunch tp=2 shm": [*dslaunch2, PORT, *worker, "dslaunch", str(model_dir), "shm"],
        "deepspeed tp=1": [str(ds / "python"), *worker, "deepspeed", str(model_dir), "-"],
        "deepspeed tp=2": [str(ds / "torchrun"), "--nproc-per-node", "2", "--master-port", PORT, *worker,
                           "deepspeed", str(model_dir), "-"],
    }
    load = [os.getloadavg()]
    runs: dict[str, list[dict]] = {name: [] for name in cases}
    for _ in range(args.rounds):  # rounds over all cases: a burst of load hits every case alike
        for name, cmd in cases.items():
            runs[name].append(run(cmd, env))
            print(name, {k: v for k, v in runs[name][-1].items() if k != "tokens"}, flush=True)
            load.append(os.getloadavg())
    results = {}
    for name, got in runs.items():
        ok = [r for r in got if "error" not in r]
        results[name] = min(ok, key=lambda r: r["per_token_ms"]) if ok else got[-1]
        results[name]["per_token_ms_rounds"] = [r.get("per_token_ms") for r in got]
    reference = results["dslaunch tp=1"].get("tokens")
    for r in results.values():
        if "tokens" in r:
            r["same_tokens_as_dslaunch_tp1"] = r.pop("tokens") == reference
    RESULTS.mkdir(exist_ok=True)
    n_params = sum(p for p in [MODEL["vocab_size"] * MODEL["hidden_size"] * 2 + MODEL["num_hidden_layers"] * (
        4 * MODEL["hidden_size"] ** 2 + 3 * MODEL["hidden_size"] * MODEL["intermediate_size"])])
    payload = {"model": {**MODEL, "approx_params": n_params}, "results": results, "loadavg": load,
               "cpus": os.cpu_count()}
    (RESULTS / "inference_bench.json").write_text(json.dumps(payload, indent=1))
    (RESULTS / "inference_bench.md").write_text(table(payload))
    print(table(payload))


def table(payload: dict) -> str:
    res = payload["results"]
    base = res["dslaunch tp=1"].get("per_token_ms")
    rows = ["## Tensor-parallel inference (inference_bench)", "",
            f"Llama, {payload['model']['approx_params'] / 1e6:.0f}M parameters, fp32, batch 1, greedy, 16-token prompt, "
            "32 new tokens; each rank pinned to its own core, 1 thread; per case the best of "
            f"{len(next(iter(res.values()))['per_token_ms_rounds'])} rounds (each the median of 3). Load average (1 min) from "
            f"{min(x[0] for x in payload['loadavg']):.1f} to {max(x[0] for x in payload['loadavg']):.1f} on "
            f"{payload['cpus']} cores.", "",
            "| case | per-token ms | tokens/s | vs dslaunch tp=1 | rank 0 weights MB | same tokens |",
            "| --- | ---: | ---: | ---: | ---: | --- |"]
    for name, r in res.items():
        if "error" in r:
            rows.append(f"| {name} | failed: {r['error'].splitlines()[-1][:80] if r['error'] else '?'} | | | | |")
            continue
        ratio = f"{r['per_token_ms'] / base:.2f}x" if base else "-"
        rows.append(f"| {name} | {r['per_token_ms']:.1f} | {r['tokens_per_s']:.1f} | {ratio} | "
                    f"{r['param_bytes_rank0'] / 2**20:.0f} | {r['same_tokens_as_dslaunch_tp1']} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    sys.exit(main())
