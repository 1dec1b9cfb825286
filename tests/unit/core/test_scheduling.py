"""core.scheduling.WaitingQueue: priority order, weighted fair order, no credit banking, and
the head-of-line rule the engines build on it."""

from __future__ import annotations

import pytest

from core.scheduling import Running, WaitingQueue


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


# ------------------------------------------------------------------ preemption


def running(*specs: tuple[int, str, int]) -> list[Running]:
    """Running requests of one sequence each: (priority, tenant, seq)."""
    return [Running(priority, tenant, 1, seq) for priority, tenant, seq in specs]


def test_fcfs_with_one_tenant_never_preempts() -> None:
    q: WaitingQueue[str] = WaitingQueue("fcfs")
    seqs = [q.push(f"r{i}", cost=10) for i in range(4)]
    for _ in range(2):
        q.pop()
    batch = running((0, "", seqs[0]), (0, "", seqs[1]))
    assert q.preemption_victims(batch, head_rows=1, free_rows=0, batch_rows=2, limit=4) == []


def test_priority_preempts_the_lowest_priority_newest() -> None:
    q: WaitingQueue[str] = WaitingQueue("priority")
    batch = running((0, "", 1), (5, "", 2), (5, "", 3), (-1, "", 4))
    q.push("high", cost=10, priority=-1)
    assert q.preemption_victims(batch, head_rows=1, free_rows=0, batch_rows=4, limit=4) == [2]
    # two rows needed: the two priority-5 requests, newest first
    assert q.preemption_victims(batch, head_rows=2, free_rows=0, batch_rows=4, limit=4) == [2, 1]
    # three rows: only three requests rank below it, and the limit caps the preemptions
    assert q.preemption_victims(batch, head_rows=3, free_rows=0, batch_rows=4, limit=4) == [2, 1, 0]
    assert q.preemption_victims(batch, head_rows=3, free_rows=0, batch_rows=4, limit=2) == []
    assert q.preemption_victims(batch, head_rows=4, free_rows=0, batch_rows=4, limit=4) == []  # -1 stays
    assert q.preemption_victims(batch, head_rows=1, free_rows=1, batch_rows=5, limit=4) == []  # it fits


def test_fcfs_ignores_priority_for_preemption() -> None:
    q: WaitingQueue[str] = WaitingQueue("fcfs")
    q.push("high", cost=10, priority=-1)
    assert q.preemption_victims(running((5, "", 0)), head_rows=1, free_rows=0, batch_rows=1, limit=4) == []


def test_equal_priority_never_preempts_within_a_tenant() -> None:
    q: WaitingQueue[str] = WaitingQueue("priority")
    q.push("a-late", cost=10, tenant="a")
    batch = running((0, "a", 10), (0, "a", 11))
    assert q.preemption_victims(batch, head_rows=1, free_rows=0, batch_rows=2, limit=4) == []


def noisy_queue() -> tuple[WaitingQueue[str], list[Running]]:
    """Tenant a holds the whole batch of 4 and has more waiting; b arrives."""
    q: WaitingQueue[str] = WaitingQueue()
    seqs = [q.push(f"a{i}", cost=10, tenant="a") for i in range(6)]
    for _ in range(4):
        assert q.pop().startswith("a")
    q.push("b0", cost=10, tenant="b")
    return q, [Running(0, "a", 1, s) for s in seqs[:4]]


def test_a_tenant_under_its_share_preempts_the_newest_of_the_one_over() -> None:
    q, batch = noisy_queue()
    assert q.peek() == "b0"
    assert q.preemption_victims(batch, head_rows=1, free_rows=0, batch_rows=4, limit=4) == [3]


def test_preempted_request_resumes_at_its_place_and_does_not_preempt_back() -> None:
    q, batch = noisy_queue()
    [victim] = q.preemption_victims(batch, head_rows=1, free_rows=0, batch_rows=4, limit=4)
    q.push("a3", cost=0, tenant="a", seq=batch[victim].seq)  # requeued, charged already
    assert q.pop() == "b0"
    b_seq = 99
    batch[victim] = Running(0, "b", 1, b_seq)
    # a3 waits ahead of a's later arrivals, and b holds no more than its share: no ping-pong
    assert q.peek() == "a3"
    assert q.preemption_victims(batch, head_rows=1, free_rows=0, batch_rows=4, limit=4) == []
    assert drain(q) == ["a3", "a4", "a5"]


def test_no_preemption_when_the_waiting_tenant_would_exceed_its_share() -> None:
    q: WaitingQueue[str] = WaitingQueue()
    a0 = q.push("a0", cost=100, tenant="a")
    q.push("a1", cost=100, tenant="a")
    assert q.pop() == "a0"
    bs = [q.push(f"b{i}", cost=1, tenant="b") for i in range(4)]
    assert [q.pop(), q.pop()] == ["b0", "b1"]
    assert q.peek() == "b2"  # b is far behind a in virtual time
    # b holds 2 of a batch of 4, its share with a: one more would put it over
    batch = [Running(0, "b", 1, bs[0]), Running(0, "b", 1, bs[1]), Running(0, "a", 1, a0), Running(0, "a", 1, 9)]
    assert q.preemption_victims(batch, head_rows=1, free_rows=0, batch_rows=4, limit=4) == []
    # with a holding 3 of them, b (1 + 1 <= 2) takes a's newest
    batch[1] = Running(0, "a", 1, 10)
    assert q.preemption_victims(batch, head_rows=1, free_rows=0, batch_rows=4, limit=4) == [1]


def test_weights_set_the_batch_share() -> None:
    q: WaitingQueue[str] = WaitingQueue(weights={"a": 3.0})
    for i in range(8):
        q.push(f"a{i}", cost=10, tenant="a")
    for _ in range(4):
        q.pop()
    q.push("b0", cost=10, tenant="b")
    # a holds 3 of 4 rows, its weighted share: b's request waits for a slot to free
    batch = [Running(0, "a", 1, i) for i in range(3)] + [Running(0, "b", 1, 50)]
    assert q.preemption_victims(batch, head_rows=1, free_rows=0, batch_rows=4, limit=4) == []
    # a holds all 4: over its share of 3, so b takes one
    batch = [Running(0, "a", 1, i) for i in range(4)]
    assert q.preemption_victims(batch, head_rows=1, free_rows=0, batch_rows=4, limit=4) == [3]


def test_only_preemptible_requests_are_victims() -> None:
    q: WaitingQueue[str] = WaitingQueue("priority")
    q.push("high", cost=10, priority=-1)
    batch = [Running(0, "", 1, 0, preemptible=False), Running(0, "", 1, 1)]
    assert q.preemption_victims(batch, head_rows=1, free_rows=0, batch_rows=2, limit=4) == [1]
    batch[1] = Running(0, "", 1, 1, preemptible=False)
    assert q.preemption_victims(batch, head_rows=1, free_rows=0, batch_rows=2, limit=4) == []
    assert WaitingQueue().preemption_victims(batch, head_rows=1, free_rows=0, batch_rows=2, limit=4) == []


# ------------------------------------------------------------------ a full queue


def test_full_queue_arrival_under_its_share_displaces_the_newest_of_the_most_over() -> None:
    q: WaitingQueue[str] = WaitingQueue()
    for i in range(4):
        q.push(f"a{i}", cost=10, tenant="a")
    q.push("c0", cost=10, tenant="c")
    # queue of 5, three tenants with b arriving: shares 5/3; a holds 4
    assert q.make_room("b") == "a3"
    q.push("b0", cost=10, tenant="b")
    # b now holds 1; one more would put it over 5/3: refused, and so is c
    assert q.make_room("b") is None and q.make_room("c") is None
    # a new tenant d: a (3 of 5, shares 5/4) gives its newest again
    assert q.make_room("d") == "a2"
    assert len(q) == 4 and sorted(q) == ["a0", "a1", "b0", "c0"]
    assert q.vtime("a") == 0  # displaced requests are not charged


def test_full_queue_of_one_tenant_refuses_as_before() -> None:
    q: WaitingQueue[str] = WaitingQueue()
    for i in range(3):
        q.push(f"r{i}", cost=10)
    assert q.make_room("") is None
    assert q.make_room("other") == "r2"  # any other tenant is under its share
    assert WaitingQueue().make_room("x") is None  # a queue of size 0 holds nobody


def test_weights_set_the_queue_share_and_resumed_requests_stay() -> None:
    q: WaitingQueue[str] = WaitingQueue(weights={"gold": 3.0})
    for i in range(3):
        q.push(f"g{i}", cost=10, tenant="gold")
    q.push("s0", cost=10, tenant="silver")
    # queue 4: gold's share 3, silver's 1: neither displaces the other
    assert q.make_room("silver") is None and q.make_room("gold") is None
    q2: WaitingQueue[str] = WaitingQueue()
    q2.push("resumed", cost=0, tenant="a", seq=0)
    q2.push("a-new", cost=10, tenant="a")
    assert q2.make_room("b") == "a-new"
    assert q2.make_room("c") is None  # a's only request waiting had been preempted
