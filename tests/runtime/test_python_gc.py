"""``disable_python_gc``'s shared switch (``runtime/python_gc.py``): off while an engine that asked
lives, back on after the last, collections on request; a fork gets collection back."""

from __future__ import annotations

import gc
import os

import pytest

from dslaunch.runtime.python_gc import PythonGC
from tests.distributed import one_rank


@pytest.fixture
def collecting():
    was = gc.isenabled()
    gc.enable()
    yield
    (gc.enable if was else gc.disable)()


@pytest.mark.timeout(30)
def test_off_while_engines_live_and_back_after_the_last(collecting) -> None:
    shared = PythonGC()
    a = shared.acquire()
    assert not gc.isenabled() and shared.engines == 1
    b = shared.acquire()
    shared.release(a)
    assert not gc.isenabled()  # the second engine still lives
    shared.release(b)
    assert gc.isenabled() and shared.engines == 0
    shared.release(b)  # a second release changes nothing
    assert gc.isenabled() and shared.engines == 0


@pytest.mark.timeout(30)
def test_left_off_when_it_was_off_before(collecting) -> None:
    shared = PythonGC()
    gc.disable()
    shared.release(shared.acquire())
    assert not gc.isenabled()


@pytest.mark.timeout(30)
def test_collect_finds_cycles_and_keeps_the_switch(collecting) -> None:
    shared = PythonGC()
    handle = shared.acquire()

    class Node:
        pass

    for _ in range(10):
        a, b = Node(), Node()
        a.other, b.other = b, a
    del a, b
    assert shared.collect() >= 20 and not gc.isenabled()
    shared.release(handle)


@pytest.mark.timeout(30)
def test_a_forked_child_collects_again(collecting) -> None:
    shared = PythonGC()
    handle = shared.acquire()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no engine of its own, the switch back on
        os.write(write, b"1" if gc.isenabled() and shared.engines == 0 else b"0")
        os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(read, 1) == b"1"
    assert not gc.isenabled()  # the parent's engine still holds it off
    shared.release(handle)
    assert gc.isenabled()


@pytest.mark.timeout(60)
@one_rank
def test_an_engine_holds_the_switch_until_destroyed() -> None:
    import torch

    import dslaunch

    gc.enable()
    config = {"train_micro_batch_size_per_gpu": 1, "disable_python_gc": True,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, *_ = dslaunch.initialize(model=torch.nn.Linear(2, 2), config=config)
    assert not gc.isenabled() and engine.collect_python_gc() >= 0 and not gc.isenabled()
    engine.backward(engine(torch.ones(1, 2)).sum())
    engine.step()
    engine.destroy()
    assert gc.isenabled()
    plain, *_ = dslaunch.initialize(model=torch.nn.Linear(2, 2), config={**config, "disable_python_gc": False})
    assert gc.isenabled()  # the default leaves the collector alone
