"""Client-side adaptive throttling alone (``client.throttle``): the SRE formula over a sliding
window, per org, with answers counted when they come back."""

from __future__ import annotations

import pytest

from ibex_context.client.throttle import MAX_ORGS, Throttle


def test_an_org_the_service_serves_is_never_refused() -> None:
    t = Throttle(2.0, 2.0, rand=lambda: 0.0)  # the most refusing draw: any probability above 0 refuses
    for i in range(1000):
        assert t.admit("acme", i * 0.001)
        t.answered("acme", i * 0.001, accepted=True)
    assert t.reject_probability("acme", 1.0) == 0.0


def test_refusals_past_k_times_the_accepts_raise_the_local_refusal_probability() -> None:
    t = Throttle(2.0, 2.0)
    for i in range(100):  # 100 answered: 20 accepted, 80 refused OVERLOADED
        t.answered("acme", i * 0.001, accepted=i % 5 == 0)
    assert t.reject_probability("acme", 0.1) == pytest.approx((100 - 2 * 20) / 101)


def test_a_burst_before_any_answer_is_all_sent() -> None:
    t = Throttle(2.0, 2.0, rand=lambda: 0.0)
    assert all(t.admit("acme", 0.0) for _ in range(50))


def test_one_orgs_refusals_do_not_throttle_another() -> None:
    t = Throttle(2.0, 2.0, rand=lambda: 0.0)
    for i in range(100):
        t.answered("flood", i * 0.001, accepted=False)
    assert not t.admit("flood", 0.1)
    assert t.admit("victim", 0.1) and t.reject_probability("victim", 0.1) == 0.0


def test_local_refusals_count_as_requests_and_the_window_forgets() -> None:
    t = Throttle(2.0, 2.0, rand=lambda: 0.0)
    for _ in range(10):
        t.answered("acme", 0.0, accepted=False)
    p0 = t.reject_probability("acme", 0.0)
    assert not t.admit("acme", 0.0)
    assert t.reject_probability("acme", 0.0) > p0  # the refused call counted
    assert t.reject_probability("acme", 2.5) == 0.0  # a whole window later nothing is left
    assert t.admit("acme", 2.5)


def test_k_zero_turns_it_off_and_bad_windows_are_refused() -> None:
    t = Throttle(0.0, 2.0, rand=lambda: 0.0)
    for _ in range(10):
        t.answered("acme", 0.0, accepted=False)
    assert t.admit("acme", 0.0)
    with pytest.raises(ValueError, match="window"):
        Throttle(2.0, 0.0)


def test_orgs_tracked_are_bounded() -> None:
    t = Throttle(2.0, 1.0)
    for i in range(MAX_ORGS + 10):
        t.answered(f"org{i}", 0.0, accepted=True)
    t.answered("late", 5.0, accepted=True)  # the others' windows are empty by now: pruned
    assert len(t.orgs) <= 11


def test_an_org_sending_a_trickle_is_never_refused_and_one_over_it_is() -> None:
    """Below ``min_rps`` over the window the formula does not apply: after a burst of refusals an
    org sending 5 a second is not shut out for many windows by its own local refusals."""
    t = Throttle(2.0, 2.0, rand=lambda: 0.0, min_rps=10.0)
    for i in range(10):  # 5 a second, every one refused OVERLOADED
        t.answered("trickle", i * 0.2, accepted=False)
    assert t.admit("trickle", 2.0) and t.reject_probability("trickle", 2.0) == 0.0
    for i in range(40):  # 20 a second, every one refused
        t.answered("flood", i * 0.05, accepted=False)
    assert not t.admit("flood", 2.0)
