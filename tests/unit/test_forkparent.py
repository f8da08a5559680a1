"""A fork parent's bookkeeping of its children (``bench.lib.forkparent.Children``): a reused pid
never carries an earlier child's exit to a later one."""

from __future__ import annotations

from bench.lib.forkparent import Children


def test_a_reused_pid_is_a_new_child_still_running() -> None:
    kids = Children()
    kids.on_event({"forked": 4242})
    first = kids.forked.get_nowait()
    kids.on_event({"exit": 4242, "status": 0})
    kids.on_event({"forked": 4242})  # the kernel gave the pid again
    second = kids.forked.get_nowait()
    assert first != second
    assert kids.exits.get(first[1]) == 0
    assert second[1] not in kids.exits  # running, not "exited with status 0 before binding"
    kids.on_event({"exit": 4242, "status": -15})
    assert kids.exits[first[1]] == 0 and kids.exits[second[1]] == -15


def test_an_exit_of_a_pid_never_forked_is_ignored() -> None:
    kids = Children()
    kids.on_event({"exit": 7, "status": 1})
    assert kids.exits == {} and kids.running == {}


def test_a_parent_that_ends_answers_a_waiting_fork_request_with_none() -> None:
    kids = Children()
    kids.ended()
    assert not kids.alive and kids.forked.get_nowait() == (0, 0)
