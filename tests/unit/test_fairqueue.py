"""The broker's fair queue alone (``broker.fairqueue``): weighted fair order, FIFO within an org,
work conservation, lazy removal, push-out when full, and bounded bookkeeping; with a property test
against a plain model of per-org lists."""

from __future__ import annotations

import collections

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ibex_context.broker.fairqueue import IDLE_CAP, FairQueue
from ibex_context.broker.org_counts import TopCounts, org_snapshot
from ibex_context.shared.config.org_weights import parse_org_weights
from tests.properties import examples


def drain(q: FairQueue[str], n: int | None = None) -> list[tuple[str, str]]:
    out = []
    while q and (n is None or len(out) < n):
        nxt = q.pop()
        assert nxt is not None
        out.append(nxt)
    return out


def test_an_org_alone_is_served_in_order_and_takes_everything() -> None:
    q: FairQueue[str] = FairQueue()
    for i in range(5):
        q.push("acme", f"a{i}")
    assert q.share("acme") == 1.0 and len(q) == 5
    assert [item for _, item in drain(q)] == [f"a{i}" for i in range(5)]
    assert q.pop() is None and not q


def test_a_light_org_goes_ahead_of_a_flood_backlog() -> None:
    q: FairQueue[str] = FairQueue()
    for i in range(1000):
        q.push("flood", f"f{i}")
    drain(q, 10)
    q.push("light", "l0")
    nxt = drain(q, 2)
    assert ("light", "l0") in nxt  # at the next or the one after: never behind the backlog
    q.push("light", "l1")
    q.push("light", "l2")
    orgs = [org for org, _ in drain(q, 6)]
    assert orgs.count("light") == 2  # then turn about with the flood, not all of its own first


@pytest.mark.parametrize("weights", [{"a": 2.0, "b": 1.0}, {"a": 1.0, "b": 3.0}, {"a": 0.5, "b": 1.0, "c": 2.0}])
def test_backlogged_orgs_are_served_in_proportion_to_their_weights(weights: dict[str, float]) -> None:
    q: FairQueue[str] = FairQueue(weights)
    for org in weights:
        for i in range(2000):
            q.push(org, f"{org}{i}")
    served = collections.Counter(org for org, _ in drain(q, 700))
    total = sum(weights.values())
    for org, w in weights.items():
        assert abs(served[org] - 700 * w / total) <= 2, served


def test_an_idle_org_banks_no_credit_and_one_that_just_emptied_is_not_ahead() -> None:
    q: FairQueue[str] = FairQueue()
    q.push("b", "b0")
    drain(q)
    for i in range(100):
        q.push("a", f"a{i}")
    drain(q, 50)  # b was idle meanwhile: it does not get 50 turns in a row when it comes back
    for i in range(10):
        q.push("b", f"b{i + 1}")
    orgs = "".join(org for org, _ in drain(q, 10))
    assert orgs.count("b") <= 6 and "bbb" not in orgs, orgs


def test_remove_forgets_an_item_and_compacts() -> None:
    q: FairQueue[str] = FairQueue()
    for i in range(200):
        q.push("a", f"a{i}")
    for i in range(0, 190):
        q.remove("a", f"a{i}")
    assert len(q) == 10 and q.queued("a") == 10
    assert len(q.orgs["a"].items) <= 2 * 10 + 32  # dead entries do not pile up
    assert [item for _, item in drain(q)] == [f"a{i}" for i in range(190, 200)]
    q.push("a", "x")
    q.remove("a", "x")
    assert not q and q.active == 0 and q.active_weight == 0.0 and q.pop() is None


def test_push_out_takes_the_newest_of_the_org_most_over_its_share() -> None:
    q: FairQueue[str] = FairQueue({"big": 2.0})
    for i in range(6):
        q.push("big", f"big{i}")
    for i in range(4):
        q.push("mid", f"mid{i}")
    # full at 10: "mid" holds 4 per weight, "big" 3; a newcomer under its share pushes out mid's newest
    assert q.push_out("new", 10) == ("mid", "mid3")
    assert q.queued("mid") == 3 and len(q) == 9
    q.push("new", "new0")
    # "mid" at or over its share of 10 (10 x 1/4): refused itself, nothing pushed out
    assert q.push_out("mid", 10) is None
    assert len(q) == 10


def test_a_skipped_org_gives_nothing_and_keeps_its_place() -> None:
    q: FairQueue[str] = FairQueue()
    for i in range(3):
        q.push("globex", f"g{i}")
        q.push("acme", f"a{i}")
    assert q.pop() == ("globex", "g0")
    assert q.pop(skip={"globex"}) == ("acme", "a0")
    assert q.pop(skip={"globex"}) == ("acme", "a1")
    assert q.pop(skip={"globex", "acme"}) is None  # everyone skipped: nothing, and nothing lost
    assert len(q) == 3 and q.queued("globex") == 2
    assert drain(q) == [("globex", "g1"), ("acme", "a2"), ("globex", "g2")]


def test_bookkeeping_stays_bounded_when_many_orgs_come_and_go() -> None:
    q: FairQueue[str] = FairQueue()
    for i in range(20 * IDLE_CAP):
        q.push(f"org{i}", "x")
        q.push("steady", f"s{i}")
        drain(q, 2)
    assert len(q.orgs) <= 2 and len(q.idle) <= 2 * IDLE_CAP + 1 and len(q.fullest) <= 2 * q.active + 65


def test_org_weights_setting() -> None:
    assert parse_org_weights(" acme=2, beta=0.5 ,") == {"acme": 2.0, "beta": 0.5}
    assert parse_org_weights(None) == {}
    for bad in ("acme", "acme=0", "acme=-1", "acme=x", "a b=1", "acme=nan", "acme=inf"):
        with pytest.raises(ValueError, match="org=weight"):
            parse_org_weights(bad)


def test_per_org_counts_are_bounded() -> None:
    shed = TopCounts(cap=8)
    for i in range(100):
        shed.add("heavy")
        shed.add(f"one-off-{i}")
    assert len(shed.counts) <= 8 and shed.get("heavy") == 100
    snap = org_snapshot([(f"o{i}", i) for i in range(50)], ["o3", "o3", "x"], shed, shown=5)
    orgs = snap["orgs"]
    assert isinstance(orgs, dict) and list(orgs)[:5] == ["o49", "o48", "o47", "o46", "o45"]
    other = snap["orgs_other"]
    assert isinstance(other, dict) and other["orgs"] == 50 + 1 + len(shed.counts) - 5
    assert other["inflight"] == 3
    snap = org_snapshot([("acme", 1)], [], TopCounts(), [("globex", 4), ("acme", 2)], shown=5)
    assert snap["orgs"] == {"globex": {"queued": 0, "inflight": 0, "shed": 0, "held": 4},
                            "acme": {"queued": 1, "inflight": 0, "shed": 0, "held": 2}}


# ------------------------------------------------------------------------------- property test

OPS = st.lists(st.tuples(st.sampled_from(["push", "push_front", "pop", "pop_skip", "remove", "push_out"]),
                         st.sampled_from(["a", "b", "c", "d"]), st.integers(0, 30)), max_size=300)


@settings(max_examples=examples(300), deadline=None)
@given(OPS, st.dictionaries(st.sampled_from(["a", "b", "c"]), st.sampled_from([0.5, 1.0, 2.0, 3.0])))
def test_the_queue_agrees_with_a_model_of_per_org_lists(ops: list[tuple[str, str, int]],
                                                         weights: dict[str, float]) -> None:
    q: FairQueue[int] = FairQueue(weights)
    model: dict[str, list[int]] = collections.defaultdict(list)
    next_item = 0
    for op, org, arg in ops:
        if op in ("push", "push_front"):
            next_item += 1
            (q.push if op == "push" else q.push_front)(org, next_item)
            model[org].append(next_item) if op == "push" else model[org].insert(0, next_item)
        elif op == "pop":
            got = q.pop()
            if not any(model.values()):
                assert got is None
            else:
                assert got is not None and model[got[0]][0] == got[1]  # FIFO within the org
                model[got[0]].pop(0)
        elif op == "pop_skip":  # ``org``'s held slots take every free one: the next of another org
            got = q.pop(skip={org})
            if not any(v for o, v in model.items() if o != org):
                assert got is None
            else:
                assert got is not None and got[0] != org and model[got[0]][0] == got[1]
                model[got[0]].pop(0)
        elif op == "remove" and model[org]:
            item = model[org].pop(arg % len(model[org]))
            q.remove(org, item)
        elif op == "push_out":
            limit = sum(map(len, model.values()))
            out = q.push_out(org, limit)
            if out is not None:
                victim, item = out
                load = {o: len(v) / q.weight(o) for o, v in model.items() if v}
                assert victim != org and load[victim] == max(load.values()) and model[victim][-1] == item
                model[victim].pop()
        assert len(q) == sum(map(len, model.values()))
        assert all(q.queued(o) == len(v) for o, v in model.items())
        active = [o for o, v in model.items() if v]
        assert q.active == len(active) and q.active_weight == pytest.approx(sum(q.weight(o) for o in active))


def test_an_org_served_newest_first_gives_its_newest_and_keeps_its_share() -> None:
    q: FairQueue[str] = FairQueue()
    for i in range(4):
        q.push("flood", f"f{i}")
    q.push("light", "l0")
    q.push("light", "l1")
    q.remove("flood", "f3")  # a dead entry at the back is skipped
    out = [q.pop(newest_first={"flood"}) for _ in range(4)]
    assert out == [("flood", "f2"), ("light", "l0"), ("flood", "f1"), ("light", "l1")]
    assert q.oldest("flood") == "f0" and q.oldest("light") is None


def test_oldest_skips_dead_entries_and_leaves_the_item_queued() -> None:
    q: FairQueue[str] = FairQueue()
    for i in range(3):
        q.push("acme", f"a{i}")
    q.remove("acme", "a0")
    assert q.oldest("acme") == "a1" and len(q) == 2
    assert drain(q) == [("acme", "a1"), ("acme", "a2")]
    assert q.oldest("acme") is None and q.oldest("nobody") is None
