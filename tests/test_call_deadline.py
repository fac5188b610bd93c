"""cachefuse.call_deadline: a scope's deadline is its thread's only, an enclosing earlier one wins, and a
deadline that has passed refuses calls and marks its scope cut (each with the case that must differ)."""

from __future__ import annotations

import threading

from cachefuse import call_deadline
from cachefuse.call_deadline import calls_within
from tests.helpers.trickling_proxy import TestClock


def test_a_scope_sets_the_deadline_on_its_clock_and_only_inside():
    clock = TestClock()
    clock.advance(10.0)
    assert call_deadline.current() is None
    with calls_within(2.0, clock) as deadline:
        assert call_deadline.current() is deadline and deadline.at == 12.0
        clock.advance(0.5)
        assert deadline.left_s() == 1.5
    assert call_deadline.current() is None


def test_no_bound_opens_no_scope():
    with calls_within(None, TestClock()) as deadline:
        assert deadline is None and call_deadline.current() is None


def test_an_earlier_enclosing_deadline_wins_and_a_later_one_does_not():
    clock = TestClock()
    with calls_within(1.0, clock) as outer:
        with calls_within(5.0, clock) as inner:
            assert inner is outer  # a nested call may not outlast what encloses it
        with calls_within(0.5, clock) as inner:
            assert inner is not outer and call_deadline.current().at == 0.5
        assert call_deadline.current() is outer


def test_a_passed_deadline_refuses_and_marks_the_scope_cut():
    clock = TestClock()
    with calls_within(1.0, clock) as deadline:
        assert not call_deadline.passed() and not call_deadline.cut_by_deadline()
        clock.advance(1.0)
        assert call_deadline.passed() and deadline.cut and call_deadline.cut_by_deadline()
    assert not call_deadline.passed()  # outside a scope nothing is refused


def test_another_thread_does_not_see_this_threads_deadline():
    seen = []
    with calls_within(1.0, TestClock()):
        thread = threading.Thread(target=lambda: seen.append(call_deadline.current()))
        thread.start()
        thread.join()
        assert call_deadline.current() is not None  # the control: this thread does
    assert seen == [None]
