"""``ContinuousBatchScheduler``: first-come admission into free rows, retirement at the token budget
or at a caller's EOS, survivors' old rows for compacting a cache, and one-line refusals."""

from __future__ import annotations

import pytest

from dslaunch.runtime.rollout.continuous_batching import (
    ContinuousBatchRequest,
    ContinuousBatchScheduler,
    ContinuousBatchUpdate,
)


def _ids(update: ContinuousBatchUpdate) -> tuple:
    return update.active_ids, update.keep_slots, update.retired, tuple(r.request_id for r in update.admitted)


@pytest.mark.timeout(30)
def test_a_decode_loop_retires_and_refills_rows() -> None:
    sched = ContinuousBatchScheduler(max_batch_size=2, max_new_tokens=3)
    for name in "abcd":
        sched.submit(ContinuousBatchRequest(name))
    first = sched.schedule()
    assert _ids(first) == (("a", "b"), (), (), ("a", "b")) and first.admitted_slots == (0, 1)
    assert [r.request_id for r in sched.pending] == ["c", "d"]
    # step 1: "a" ends at its EOS; its row goes to "c", "b" survives from row 1 to row 0
    step = sched.advance(finished_ids=["a"])
    assert _ids(step) == (("b", "c"), (1,), ("a",), ("c",)) and step.admitted_slots == (1,)
    # step 2: nothing ends; step 3: "b" made its 3rd token (budget), "d" takes the free row
    assert _ids(sched.advance()) == (("b", "c"), (0, 1), (), ())
    assert _ids(sched.advance()) == (("c", "d"), (1,), ("b",), ("d",))
    # "c" (2 tokens so far) reaches the budget at the next step; "d" ends by EOS the step after
    assert _ids(sched.advance()) == (("d",), (1,), ("c",), ())
    assert _ids(sched.advance(["d"])) == ((), (), ("d",), ())
    assert sched.active == () and sched.pending == ()
    sched.submit(ContinuousBatchRequest("a"))  # a retired id may come back
    assert _ids(sched.schedule()) == (("a",), (), (), ("a",))


@pytest.mark.timeout(30)
def test_schedule_retires_without_a_decode_step() -> None:
    sched = ContinuousBatchScheduler(max_batch_size=3, max_new_tokens=1)
    for n in range(3):
        sched.submit(ContinuousBatchRequest(n))
    sched.schedule()
    assert _ids(sched.schedule([1])) == ((0, 2), (0, 2), (1,), ())
    assert _ids(sched.advance()) == ((), (), (0, 2), ())  # a budget of 1: both retire at the first step


@pytest.mark.timeout(30)
def test_what_is_wrong_is_one_line() -> None:
    for args, words in [((0, 4), "max_batch_size must be positive; got 0"), ((1, 0), "max_new_tokens must be positive")]:
        with pytest.raises(ValueError, match="^" + words):
            ContinuousBatchScheduler(*args)
    sched = ContinuousBatchScheduler(2, 4)
    sched.submit(ContinuousBatchRequest(7))
    with pytest.raises(ValueError, match=r"^duplicate request_id: 7$"):
        sched.submit(ContinuousBatchRequest(7))  # pending
    sched.schedule()
    with pytest.raises(ValueError, match=r"^duplicate request_id: 7$"):
        sched.submit(ContinuousBatchRequest(7))  # active
    with pytest.raises(TypeError, match=r"^request must be a ContinuousBatchRequest; got int$"):
        sched.submit(7)
    for call in (sched.schedule, sched.advance):
        with pytest.raises(ValueError, match=r"^finished request is not active: 8$"):
            call([8])
    assert _ids(sched.advance()) == ((7,), (0,), (), ())  # the refused calls changed nothing
