"""Slices marked for a refresh: a mark wakes only the daemon of the slice's package, marks of an
unknown package (from the pod watches) are routed once, and a slice marked twice is refreshed once."""

from __future__ import annotations

from gpuslice.operator.changes import Changes


def test_a_mark_of_one_package_wakes_only_its_daemon() -> None:
    changes = Changes()
    a, b = changes.listen("a"), changes.listen("b")
    changes.mark([("ns", "x")], "a")
    assert a.is_set() and not b.is_set()
    a.clear()
    changes.mark([("ns", "x")], "a")  # already marked: its daemon is already woken
    assert not a.is_set()
    assert changes.take("b", lambda ref: None) == []
    assert changes.take("a", lambda ref: None) == [("ns", "x")]
    assert changes.take("a", lambda ref: None) == []


def test_marks_without_a_package_are_routed_once_by_the_first_daemon_that_takes() -> None:
    changes = Changes()
    a, b = changes.listen("a"), changes.listen("b")
    changes.mark([("ns", "x"), ("ns", "y"), ("ns", "gone")])
    assert a.is_set() and b.is_set()  # whose they are is not known yet
    a.clear()
    b.clear()
    asked: list[tuple[str, str]] = []

    def package_of(ref: tuple[str, str]) -> str | None:
        asked.append(ref)
        return {"x": "a", "y": "b"}.get(ref[1])

    assert changes.take("a", package_of) == [("ns", "x")]
    assert b.is_set() and not a.is_set()  # y is b's: b is woken for it
    assert changes.take("b", package_of) == [("ns", "y")]
    assert sorted(asked) == [("ns", "gone"), ("ns", "x"), ("ns", "y")]  # each routed once
    assert changes.unrouted == set() and changes.routed == {}


def test_marks_of_a_package_without_a_daemon_wait_for_it() -> None:
    changes = Changes()
    changes.mark([("ns", "x")], "later")
    woken = changes.listen("later")
    assert not woken.is_set()  # a daemon starts with a take of its own
    assert changes.take("later", lambda ref: "later") == [("ns", "x")]
