"""One rank of ``inference_bench.py``: load the bench model, shard it with dslaunch's or DeepSpeed's
``init_inference``, and time greedy decoding. Rank 0 prints ``RESULT {json}``.

Usage (the bench starts it): ``inference_worker.py IMPL MODEL_DIR TP_ALLREDUCE`` with IMPL
``dslaunch`` or ``deepspeed``; each rank pins itself to core ``LOCAL_RANK``.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import transformers as T

PROMPT = 16
NEW = 32
REPEATS = 3


def _engine(impl: str, model_dir: str, tp: int, allreduce: str) -> torch.nn.Module:
    if impl == "dslaunch":
        import dslaunch
        from dslaunch.inference import empty_init

        with empty_init():
            model = T.AutoModelForCausalLM.from_config(T.AutoConfig.from_pretrained(model_dir))
        return dslaunch.init_inference(model.eval(), tensor_parallel={"tp_size": tp}, checkpoint=model_dir,
                                       dtype=torch.float32, tp_allreduce=allreduce)
    # DeepSpeed's CPU shared-memory all-reduce reads LOCAL_SIZE, which only its own launcher sets;
    # under torchrun it is missing and the first all-reduce segfaults (measured: SIGSEGV, both ranks).
    os.environ.setdefault("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", "1"))
    import deepspeed

    if tp > 1:
        deepspeed.init_distributed("gloo")
    model = T.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return deepspeed.init_inference(model, tensor_parallel={"tp_size": tp}, dtype=torch.float32,
                                    replace_with_kernel_inject=False)


def _generate(engine: torch.nn.Module, ids: torch.Tensor, new: int) -> tuple[float, list[int]]:
    if dist.is_initialized():
        dist.barrier()
    start = time.perf_counter()
    with torch.no_grad():
        out = engine.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    return time.perf_counter() - start, out[0, PROMPT:].tolist()


def main() -> None:
    impl, model_dir, allreduce = [a for a in sys.argv[1:] if not a.startswith("--local_rank")][:3]
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    os.sched_setaffinity(0, {rank % os.cpu_count()})  # each rank on its own core
    torch.set_num_threads(1)
    tp = int(os.environ.get("WORLD_SIZE", "1"))
    start = time.perf_counter()
    engine = _engine(impl, model_dir, tp, allreduce)
    load_s = time.perf_counter() - start
    ids = torch.arange(1, PROMPT + 1).unsqueeze(0)
    _generate(engine, ids, 4)  # warm-up
    per_token, tokens = [], []
    for _ in range(REPEATS):
        first, _ = _generate(engine, ids, 1)
        total, tokens = _generate(engine, ids, NEW + 1)
        per_token.append((total - first) / NEW)
    params = sum(p.numel() * p.element_size() for p in engine.module.parameters())
    if rank == 0:
        ms = statistics.median(per_token) * 1000
        print("RESULT " + json.dumps({"impl": impl, "tp": tp, "allreduce": getattr(engine, "allreduce_name", allreduce),
                                      "per_token_ms": ms, "tokens_per_s": 1000 / ms, "per_token_all_ms":
                                      [x * 1000 for x in per_token], "load_s": load_s, "param_bytes_rank0": params,
                                      "tokens": tokens}), flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
