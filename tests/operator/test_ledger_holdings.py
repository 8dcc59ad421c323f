"""What the ledger bills for a claim as the API shows it (operator.ledger's reading of ResourceClaims):
the device, from its allocation until it is released, once, however many pods share it and whatever
happened to the GpuSlice that asked for it. Claims are the objects kube-scheduler and
kube-controller-manager write (their managedFields times are the allocation's and deallocation's)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from gpuslice import constants as c
from gpuslice.api.usage import Price
from gpuslice.domain.ledger import Ledger, encode, load, reconcile, totals
from gpuslice.operator.ledger import holdings, metered_claim, released_at

NS = "team-a"
T0 = datetime(2026, 12, 5, 10, 0, 0, tzinfo=UTC)
EUR = Price(perHour="0.45", currency="EUR")


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def stamp(seconds: float) -> str:
    return at(seconds).strftime("%Y-%m-%dT%H:%M:%SZ")


def claim(
    *,
    allocated: float | None,
    status_write: float | None = None,
    pods: int = 1,
    deleting: float | None = None,
) -> dict[str, Any]:
    """ResourceClaim `llm` of GpuSlice llm. allocated: when kube-scheduler wrote the allocation (None:
    deallocated); status_write: its latest status write (a reservation for another pod, or the
    deallocation), which moves its managedFields time."""
    meta: dict[str, Any] = {
        "name": "llm", "namespace": NS, "uid": "claim-1",
        "labels": {c.LABEL_SLICE: "llm", c.LABEL_PACKAGE: "v100-8g"},
        "managedFields": [],
    }  # fmt: skip
    if deleting is not None:
        meta["deletionTimestamp"] = stamp(deleting)
    status: dict[str, Any] = {}
    last = status_write if status_write is not None else allocated
    fields: dict[str, Any] = {"f:status": {"f:reservedFor": {}}}
    if allocated is not None:
        fields["f:status"]["f:allocation"] = {}
        result = {"driver": c.DRIVER_NAME, "pool": "node-1", "device": "gpu-0-slice-0"}
        node = {"matchFields": [{"key": "metadata.name", "values": ["node-1"]}]}
        status["allocation"] = {
            "devices": {"results": [result]},
            "nodeSelector": {"nodeSelectorTerms": [node]},
        }
        status["reservedFor"] = [{"resource": "pods", "name": f"p{i}", "uid": f"p{i}"} for i in range(pods)]
    if last is not None:
        meta["managedFields"].append(
            {"manager": "kube-scheduler", "operation": "Update", "subresource": "status",
             "time": stamp(last), "fieldsV1": fields}
        )  # fmt: skip
    return {"apiVersion": c.DRA_GROUP_VERSION, "kind": "ResourceClaim", "metadata": meta, "status": status}


def billed_seconds(books: dict[str, Ledger], now: datetime) -> int:
    rows = [(NS, iv) for book in books.values() for iv in book.intervals]
    return sum(x.slice_seconds for x in totals(rows, now))


def bill(
    books: dict[str, Ledger], body: dict[str, Any] | None, now: datetime, released: dict[str, datetime]
) -> None:
    held = holdings([metered_claim(body)], {}) if body is not None else []
    reconcile(books, NS, held, released, {"v100-8g": EUR}, now)


def test_a_slice_deleted_while_its_pods_run_is_billed_until_its_claim_is_released() -> None:
    # GpuSlice llm deleted at 100 s: its claim is marked for deletion but three pods still use it, the
    # device stays allocated (the tenant can still allocate on it) until the claim is deallocated at 400 s.
    books: dict[str, Ledger] = {}
    bill(books, claim(allocated=0), at(50), {})
    bill(books, claim(allocated=0, pods=3, deleting=100), at(300), {})
    assert billed_seconds(books, at(300)) == 300, "a device still held must go on being billed"
    assert [iv.end for iv in books["2026-12"].intervals] == [None], "and shown as held"
    gone = claim(allocated=None, status_write=400, deleting=100)  # deallocated at 400 s, then deleted
    bill(books, None, at(410), {"claim-1": released_at(metered_claim(gone), at(410))})
    assert billed_seconds(books, at(1000)) == 400


def test_a_claim_gone_while_still_allocated_is_released_when_it_went() -> None:
    assert released_at(metered_claim(claim(allocated=0, deleting=100)), at(420)) == at(420)


@settings(max_examples=60, deadline=None)
@given(
    writes=st.lists(st.integers(min_value=1, max_value=5_000), min_size=0, max_size=8, unique=True),
    restarts=st.sets(st.integers(min_value=0, max_value=8)),
    deleted_after=st.one_of(st.none(), st.integers(min_value=0, max_value=8)),
    held=st.integers(min_value=5_001, max_value=9_000),
)
def test_a_shared_device_held_t_seconds_is_billed_t_seconds_once(
    writes: list[int], restarts: set[int], deleted_after: int | None, held: int
) -> None:
    """Pods reserve and release one claim in any order (each a status write that moves its time), the
    GpuSlice may be deleted at any point, the operator may restart between any two (its books then come
    from the stored GpuUsage only); the device, allocated at 0 and released at `held`, is billed `held`
    seconds, in one interval."""
    books: dict[str, Ledger] = {}
    bill(books, claim(allocated=0), at(0), {})
    deleting: float | None = None
    for step, when in enumerate(sorted(writes)):
        if deleted_after is not None and step >= deleted_after:
            deleting = deleting if deleting is not None else when
        bill(books, claim(allocated=0, status_write=when, pods=1 + step % 3, deleting=deleting), at(when), {})
        if step in restarts:
            books = {m: load(NS, list(encode(book, at(when)).values())) for m, book in books.items()}
    gone = claim(allocated=None, status_write=held, deleting=deleting)
    bill(books, None, at(held + 5), {"claim-1": released_at(metered_claim(gone), at(held + 5))})
    intervals = [iv for book in books.values() for iv in book.intervals]
    assert billed_seconds(books, at(held + 1_000)) == held
    assert len(intervals) == 1


def test_a_2_card_products_interval_names_both_cards_and_a_slices_only_its_one() -> None:
    body = claim(allocated=0)
    results = body["status"]["allocation"]["devices"]["results"]
    results[0]["device"] = "gpu-0-v100-x2"
    results.append({**results[0], "device": "gpu-1-v100-x2"})
    uuids = {("node-1", "gpu-0-v100-x2"): "GPU-first", ("node-1", "gpu-1-v100-x2"): "GPU-second"}
    books: dict[str, Ledger] = {}
    reconcile(books, NS, holdings([metered_claim(body)], uuids, {"v100-8g": 2.0}), {}, {}, at(0))
    wire = encode(books["2026-12"], at(60))
    dumped = [o.model_dump(by_alias=True, exclude_none=True) for o in wire.values()]
    (iv,) = dumped[0]["intervals"]
    assert (iv["gpu"], iv["gpus"]) == ("GPU-first", ["GPU-first", "GPU-second"]), "gpu stays the first card"
    assert [i.gpus for i in load(NS, list(wire.values())).intervals] == [["GPU-first", "GPU-second"]]

    one: dict[str, Ledger] = {}
    reconcile(one, NS, holdings([metered_claim(claim(allocated=0))], {}), {}, {}, at(0))
    (iv,) = next(iter(encode(one["2026-12"], at(60)).values())).model_dump(by_alias=True, exclude_none=True)[
        "intervals"
    ]
    assert "gpus" not in iv, "a slice of one card is written as before"
