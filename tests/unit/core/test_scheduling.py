"""core.scheduling.WaitingQueue: priority order, weighted fair order, no credit banking, and
the head-of-line rule the engines build on it."""

from __future__ import annotations

import pytest

from core.scheduling import WaitingQueue


def drain(q: WaitingQueue[str]) -> list[str]:
    out = []
    while q:
        out.append(q.pop())
    return out


def test_fcfs_is_fifo_and_ignores_priority() -> None:
    q: WaitingQueue[str] = WaitingQueue("fcfs")
    for i, prio in enumerate([5, -3, 0, 2]):
        q.push(f"r{i}", cost=10, priority=prio)
    assert len(q) == 4
    assert drain(q) == ["r0", "r1", "r2", "r3"]


def test_priority_lower_value_first_then_arrival() -> None:
    q: WaitingQueue[str] = WaitingQueue("priority")
    for name, prio in [("a", 0), ("b", 5), ("c", -1), ("d", 0), ("e", -1)]:
        q.push(name, cost=10, priority=prio)
    assert q.peek() == "c"
    assert drain(q) == ["c", "e", "a", "d", "b"]


def test_priority_overtakes_other_tenants_fair_share() -> None:
    q: WaitingQueue[str] = WaitingQueue("priority")
    q.push("a1", cost=10, tenant="a")
    q.push("b1", cost=10, tenant="b", priority=-1)
    assert q.pop() == "b1"  # b's virtual time is now ahead, but priority comes first
    q.push("b2", cost=10, tenant="b", priority=-1)
    assert drain(q) == ["b2", "a1"]


def test_equal_weights_alternate_by_tokens() -> None:
    q: WaitingQueue[str] = WaitingQueue()
    for i in range(4):
        q.push(f"a{i}", cost=10, tenant="a")
    for i in range(2):
        q.push(f"b{i}", cost=10, tenant="b")
    assert drain(q) == ["a0", "b0", "a1", "b1", "a2", "a3"]


def test_fair_share_counts_tokens_not_requests() -> None:
    q: WaitingQueue[str] = WaitingQueue()
    q.push("big", cost=40, tenant="a")
    q.push("a-next", cost=10, tenant="a")
    for i in range(4):
        q.push(f"b{i}", cost=10, tenant="b")
    # a's one big request is worth b's four small ones
    assert drain(q) == ["big", "b0", "b1", "b2", "b3", "a-next"]


def test_weights_split_tokens_in_proportion() -> None:
    q: WaitingQueue[str] = WaitingQueue(weights={"gold": 3.0})
    for i in range(30):
        q.push(f"g{i}", cost=10, tenant="gold")
        q.push(f"s{i}", cost=10, tenant="silver")
    first = [q.pop() for _ in range(20)]
    gold = sum(1 for r in first if r.startswith("g"))
    assert gold == 15  # 3:1
    assert q.weight("gold") == 3.0 and q.weight("silver") == 1.0


def test_idle_tenant_banks_no_credit() -> None:
    q: WaitingQueue[str] = WaitingQueue()
    for i in range(10):  # a is served alone for a while
        q.push(f"a{i}", cost=10, tenant="a")
    for _ in range(8):
        q.pop()
    # b arrives late: it starts at the current virtual time, so it alternates with a instead of
    # taking the next 8 turns for the time it was idle.
    q.push("b0", cost=10, tenant="b")
    q.push("b1", cost=10, tenant="b")
    q.push("b2", cost=10, tenant="b")
    assert drain(q) == ["b0", "a8", "b1", "a9", "b2"]


def test_tenant_idle_between_requests_restarts_at_system_time() -> None:
    q: WaitingQueue[str] = WaitingQueue()
    q.push("b0", cost=10, tenant="b")
    assert q.pop() == "b0"
    for i in range(5):
        q.push(f"a{i}", cost=10, tenant="a")
    for _ in range(3):
        q.pop()
    q.push("b1", cost=10, tenant="b")
    # b1 is served within one turn of arriving, not after a's queue, and not ahead of everything
    assert drain(q) == ["b1", "a3", "a4"]


def test_settle_refunds_unused_tokens_but_not_below_system_time() -> None:
    q: WaitingQueue[str] = WaitingQueue()
    q.push("a0", cost=100, tenant="a")
    q.push("b0", cost=10, tenant="b")
    assert q.pop() == "a0"
    assert q.vtime("a") == 100
    q.settle("a", 100, 10)  # a0 stopped after 10 tokens
    assert q.vtime("a") == 10
    q.push("a1", cost=10, tenant="a")
    assert drain(q) == ["b0", "a1"]
    q.settle("a", 1000, 0)  # a refund never goes below the system virtual time
    assert q.vtime("a") >= q.vtime("nobody")
    q.settle("unknown", 5, 1)  # an unknown or pruned tenant: nothing to do


def test_remove_if_drops_without_charging() -> None:
    q: WaitingQueue[str] = WaitingQueue()
    for name in ["a0", "a1", "b0"]:
        q.push(name, cost=10, tenant=name[0])
    assert q.remove_if(lambda r: r == "a0") == ["a0"]
    assert len(q) == 2 and sorted(q) == ["a1", "b0"]
    assert q.vtime("a") == 0
    q.clear()
    assert not q and q.peek() is None


def test_head_of_line_rule_for_engines() -> None:
    """An engine admits `peek()` while it fits and stops at the first that does not: the large
    request is admitted before anything that queued after it."""
    q: WaitingQueue[tuple[str, int]] = WaitingQueue()
    q.push(("big", 8), cost=8)
    q.push(("small", 1), cost=1)
    free = 4
    admitted = []
    while (head := q.peek()) is not None and head[1] <= free:
        admitted.append(q.pop()[0])
        free -= head[1]
    assert admitted == []  # small does not overtake big
    free = 9
    while (head := q.peek()) is not None and head[1] <= free:
        admitted.append(q.pop()[0])
        free -= head[1]
    assert admitted == ["big", "small"]


def test_pop_empty_and_bad_arguments() -> None:
    q: WaitingQueue[str] = WaitingQueue()
    with pytest.raises(IndexError):
        q.pop()
    with pytest.raises(ValueError, match="scheduling policy"):
        WaitingQueue("lifo")
    with pytest.raises(ValueError, match="tenant weight"):
        WaitingQueue(weights={"a": 0.0})
    with pytest.raises(ValueError, match="tenant weight"):
        WaitingQueue(default_weight=float("nan"))


def test_many_tenant_names_do_not_accumulate() -> None:
    q: WaitingQueue[str] = WaitingQueue()
    for i in range(1000):
        q.push(f"r{i}", cost=1, tenant=f"t{i}")
        q.pop()
        q.settle(f"t{i}", 1, 1)
    assert len(q._tenants) <= 1


def test_set_aside_lets_those_behind_pass_and_restore_keeps_the_place() -> None:
    """An admission pass that cannot admit the head yet (a LoRA adapter without a free slot in
    the HF engine) sets it aside uncharged; restore puts it back before later arrivals."""
    q: WaitingQueue[str] = WaitingQueue("fcfs")
    for name in ("a", "b", "c"):
        q.push(name, cost=10, tenant="t")
    q.set_aside()
    assert len(q) == 2
    assert q.pop() == "b"
    q.restore()
    q.push("d", cost=10, tenant="t")
    assert drain(q) == ["a", "c", "d"]
    with pytest.raises(IndexError):
        q.set_aside()
