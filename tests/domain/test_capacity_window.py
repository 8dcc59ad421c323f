"""When a package's capacity is recounted after allocations, releases and taints (domain.capacity_window)."""

from __future__ import annotations

from gpuslice.domain.capacity_window import CAPACITY_WINDOW_SECONDS, open_windows, recount_in


def recounts(changes: list[float], packages: list[str], step: float = 0.05) -> dict[str, list[float]]:
    """Drive the decision the way the operator does (a change opens windows, each package's daemon looks
    every `step` seconds whether its window closed): when each package was recounted."""
    due: dict[str, float] = {}
    done: dict[str, list[float]] = {p: [] for p in packages}
    pending = sorted(changes)
    t = 0.0
    end = (pending[-1] if pending else 0.0) + 3 * CAPACITY_WINDOW_SECONDS
    while t <= end:
        while pending and pending[0] <= t:
            due = open_windows(due, packages, pending.pop(0))
        for p in packages:
            if recount_in(due, p, t) == 0:
                del due[p]
                done[p].append(t)
        t = round(t + step, 6)
    return done


def test_nothing_changed_means_no_recount() -> None:
    assert recount_in({}, "a", 10.0) is None
    assert recounts([], ["a", "b"]) == {"a": [], "b": []}


def test_twenty_claim_changes_within_the_window_give_one_recount_per_package() -> None:
    changes = [0.1 + i * 0.04 for i in range(20)]  # 20 changes in 0.8 s
    done = recounts(changes, ["a", "b"])
    assert [len(done["a"]), len(done["b"])] == [1, 1], done
    # ...and it counts all of them: it comes after the last change.
    assert done["a"][0] >= changes[-1]


def test_a_change_waits_at_most_the_window_even_in_a_steady_stream() -> None:
    changes = [i * 0.1 for i in range(100)]  # a change every 0.1 s for 10 s: never a quiet moment
    done = recounts(changes, ["a"])["a"]
    # Deadlines are not pushed back by later changes: one recount per window, not one at the end.
    assert 9 <= len(done) <= 11, done
    for t in changes:
        first_after = min(r for r in done if r >= t)
        assert first_after - t <= CAPACITY_WINDOW_SECONDS + 0.05 + 1e-9, (t, first_after)


def test_a_package_keeps_its_deadline_and_a_new_one_gets_its_own() -> None:
    due = open_windows({}, ["a"], now=5.0, window=1.0)
    due = open_windows(due, ["a", "b"], now=5.7, window=1.0)
    assert due == {"a": 6.0, "b": 6.7}
    assert recount_in(due, "a", 5.5) == 0.5
    assert recount_in(due, "a", 6.2) == 0.0
    assert recount_in(due, "c", 6.2) is None
