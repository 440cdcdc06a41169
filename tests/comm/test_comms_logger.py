"""The comms logger on real gloo ranks: the engine's ZeRO collectives and the user's own calls
through ``dslaunch.comm`` are counted with their sizes, asynchronous ones timed to completion, and
``log_summary`` prints DeepSpeed's table (with stragglers); off, nothing is recorded."""

from __future__ import annotations

import contextlib
import io

import pytest

from tests.distributed import run_world

pytestmark = pytest.mark.timeout(120)


def _train(rank: int, world: int, logger: dict | None, steps: int) -> dict:
    import torch

    import dslaunch
    from dslaunch import comm
    from tests.runtime.models import batches, make_model

    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000, "zero_optimization": {"stage": 2},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, **({"comms_logger": logger} if logger else {})}
    engine, *_ = dslaunch.initialize(model=make_model(), config=cfg)
    for tokens, labels in batches(steps, 2 * world):
        mine = slice(2 * rank, 2 * rank + 2)
        loss = engine(tokens[mine], labels[mine])
        engine.backward(loss)
        engine.step()
    engine_rows = comm.comms_logger.summary()
    mine = torch.ones(1000)
    for _ in range(3):
        comm.all_reduce(mine, log_name="user_sum")
    work = comm.broadcast(torch.ones(250), src=1, async_op=True)
    work.wait()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        table = comm.log_summary(show_straggler=True, return_dict=True)
    n_params = sum(p.numel() for p in engine.module.parameters())
    return {"engine": _plain(engine_rows), "table": _plain(table), "printed": out.getvalue(), "n_params": n_params,
            "exchange": engine.zero.exchange.name}


def _plain(summary: dict) -> dict:
    return {name: {int(size): dict(e) for size, e in by.items()} for name, by in summary.items()}


def test_engine_and_user_collectives_are_counted_and_printed_as_deepspeeds_table() -> None:
    got = run_world(_train, 2, {"enabled": True}, 3)
    # the reducer's buckets and the publisher's shards: over gloo all-reduces and broadcasts; through
    # shared memory (the default on one host) a reduce-scatter into each rank's range and all-gathers
    shm = got[0]["exchange"] == "shared_memory"
    gradients = "reduce_scatter" if shm else "all_reduce"
    reduced = [sum(size * e["count"] for size, e in g["engine"][gradients].items()) for g in got]
    grads = 3 * got[0]["n_params"] * 4  # every step reduces every gradient once (fp32)
    if shm:
        assert sum(reduced) == grads  # each rank counts the bytes of its range
    for g, mine in zip(got, reduced, strict=True):
        engine = g["engine"]
        assert set(engine) >= {"all_reduce", "all_gather" if shm else "broadcast"}
        if not shm:  # plus the 1-element norm reductions
            assert grads <= mine <= grads + 3 * 8 * 4
        for by in engine.values():
            for e in by.values():
                assert e["count"] > 0 and e["total_latency"] > 0 and e["avg_latency"] > 0
        table = g["table"]
        assert list(table["user_sum"]) == [4000]  # 1000 fp32 elements
        user = table["user_sum"][4000]
        assert user["count"] == 3 and user["algbw"] > 0
        assert user["busbw"] == pytest.approx(user["algbw"])  # 2 (n - 1) / n = 1 for 2 ranks
        assert table["broadcast"][1000]["count"] == 1  # the async one, recorded at completion
        assert all(e["straggler"] is not None and e["straggler"] >= 0 for e in table["user_sum"].values())
    printed = got[0]["printed"].splitlines()
    assert printed[0].split() == ["Comm.", "Op", "Message", "Size", "Count", "Total", "Latency(ms)", "Avg",
                                  "Latency(ms)", "tput_avg", "(Gbps)", "busbw_avg", "(Gbps)", "Total",
                                  "Straggler(ms)"]
    row = printed[printed.index("user_sum") + 1].split()
    assert row[:3] == ["3.91", "KB", "3"]
    assert got[1]["printed"] == ""  # rank 0 prints


def test_off_by_default_nothing_is_recorded() -> None:
    got = run_world(_train, 2, None, 2)
    assert all(g["engine"] == {} and g["table"] == {} for g in got)
    assert got[0]["printed"].count("\n") == 1 and got[1]["printed"] == ""  # the header alone


def _only_ops(rank: int, world: int) -> dict:
    import torch

    from dslaunch import comm, init_distributed

    init_distributed()
    comm.configure(enabled=True, prof_all=False, prof_ops=["broadcast"], debug=True)
    t = torch.ones(8)
    comm.all_reduce(t)
    comm.broadcast(t, src=0)
    comm.all_gather_into_tensor(torch.empty(16), t)
    comm.start_profiling_op(["all_gather_into_tensor"])
    comm.all_gather_into_tensor(torch.empty(16), t)
    rows = _plain(comm.comms_logger.summary())
    comm.configure(enabled=False)
    return rows


def test_prof_ops_picks_operations_and_debug_names_the_caller() -> None:
    rows = run_world(_only_ops, 2)[0]
    assert sorted(rows) == ["all_gather_into_tensor | [Caller Func: _only_ops]",
                            "broadcast | [Caller Func: _only_ops]"]
    gathered = rows["all_gather_into_tensor | [Caller Func: _only_ops]"][32]
    # 32 bytes from each of 2 ranks: algbw counts the 64 bytes every rank ends with, busbw half of them
    assert gathered["count"] == 1 and gathered["busbw"] == pytest.approx(gathered["algbw"] / 2)


def _late_source(rank: int, world: int) -> dict:
    import time

    import torch

    from dslaunch import comm, init_distributed

    init_distributed()
    comm.configure(enabled=True, verbose=True)
    t = torch.zeros(4)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        if rank == 0:
            time.sleep(0.3)  # the source issues its part late
        start = time.perf_counter()
        work = comm.broadcast(t, src=0, async_op=True)
        issued_s = time.perf_counter() - start
        work.wait()
        time.sleep(0.05)  # the completion callback runs on gloo's thread
    rows = _plain(comm.comms_logger.summary())
    comm.configure(enabled=False)
    return {"issued_s": issued_s, "latency_ms": rows["broadcast"][16]["total_latency"], "printed": out.getvalue()}


def test_an_async_collective_is_timed_to_its_completion_not_its_launch() -> None:
    got = run_world(_late_source, 2)
    late = got[1]  # rank 1 issued at once and waited ~0.3 s for rank 0's data
    assert late["issued_s"] < 0.1 and late["latency_ms"] > 200
    assert got[0]["printed"].startswith("rank=0 | comm op: broadcast | time (ms): ")  # verbose: rank 0 prints
    assert got[1]["printed"] == ""


def test_raw_records_keep_deepspeeds_layout_and_a_summary_does_not_reorder_them() -> None:
    from dslaunch.runtime.comm.comms_logging import CommsLogger, convert_size

    logger = CommsLogger()
    for latency_ms in (3.0, 1.0, 2.0):
        logger.append("all_reduce", "all_reduce", latency_ms, 1024, n=2)
    before = {name: {size: [row[0], *map(list, row[1:])] for size, row in by.items()}
              for name, by in logger.get_raw_data().items()}
    summary = logger.get_operation_summary("all_reduce")
    count, latencies, algbws, busbws = logger.get_raw_data()["all_reduce"][1024]
    assert (count, latencies) == (3, [3.0, 1.0, 2.0])  # [count, latencies, algbws, busbws], in call order
    assert len({round(lat * bw, 9) for lat, bw in zip(latencies, algbws, strict=True)}) == 1  # still paired
    assert busbws == pytest.approx(algbws)  # all_reduce on 2 ranks: busbw = algbw * 2 * 1/2
    assert logger.get_raw_data() == before
    assert summary == {1024: {"count": 3, "total_latency_ms": 6.0, "avg_latency_ms": 2.0,
                              "tput_avg_gbps": pytest.approx(sum(algbws) / 3),
                              "busbw_avg_gbps": pytest.approx(sum(busbws) / 3), "msg_size_bytes": 1024,
                              "msg_size_str": convert_size(1024)}}
    assert logger.get_operation_summary("broadcast") is None
    assert logger.summary()["all_reduce"][1024]["avg_latency"] == 2.0


def test_deepspeeds_record_queries_count_names_and_clear() -> None:
    from dslaunch.runtime.comm.comms_logging import CommsLogger

    logger = CommsLogger()
    assert not logger.has_data() and logger.get_total_operations() == 0 and logger.get_operation_names() == []
    for name, size in (("broadcast", 8), ("all_reduce", 1024), ("all_reduce", 1024), ("all_reduce", 16)):
        logger.append(name, name, 1.0, size, n=2)
    assert logger.has_data()
    assert logger.get_operation_names() == ["broadcast", "all_reduce"]
    assert logger.get_total_operations() == 4
    logger.reset_data()
    assert not logger.has_data() and logger.get_raw_data() == {}
