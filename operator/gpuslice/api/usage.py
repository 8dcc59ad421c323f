"""GpuUsage: the metering ledger, one namespace's slice-hours of one UTC calendar month (namespaced).

Only the operator writes it. An object holds at most `SHARD_MAX_INTERVALS` intervals; a month with
more continues in further objects of the same month (`<month>-<n>`), so each stays far below etcd's
object limit whatever the names in it (see `domain.ledger`). The first object of a month (named
`<month>`, shard 0) also carries the month's totals, which `kubectl get gpuusages` prints.
"""

from __future__ import annotations

from pydantic import Field, field_validator

from gpuslice.api.camel import CamelModel

#: Intervals per object. An interval encodes in at most ~1,700 bytes whatever its names (Kubernetes
#: caps object and node names at 253 characters), so 700 keep an object under ~1.2 MB, below etcd's
#: default 1.5 MiB request limit; with the usual names an object of 700 intervals is ~250 KB.
SHARD_MAX_INTERVALS = 700
#: A price per hour: a decimal string, at most 9 digits before the point and 6 after.
PER_HOUR_PATTERN = r"^(0|[1-9][0-9]{0,8})(\.[0-9]{1,6})?$"
#: An object's encoded size is checked against this before every write (and refused loudly past it).
MAX_OBJECT_BYTES = 1_400_000


#: ISO 4217 codes of circulating currencies (no funds, metals or test codes): what a price may be in.
CURRENCIES: frozenset[str] = frozenset(
    {
        "AED",
        "AFN",
        "ALL",
        "AMD",
        "AOA",
        "ARS",
        "AUD",
        "AWG",
        "AZN",
        "BAM",
        "BBD",
        "BDT",
        "BGN",
        "BHD",
        "BIF",
        "BMD",
        "BND",
        "BOB",
        "BRL",
        "BSD",
        "BTN",
        "BWP",
        "BYN",
        "BZD",
        "CAD",
        "CDF",
        "CHF",
        "CLP",
        "CNY",
        "COP",
        "CRC",
        "CUP",
        "CVE",
        "CZK",
        "DJF",
        "DKK",
        "DOP",
        "DZD",
        "EGP",
        "ERN",
        "ETB",
        "EUR",
        "FJD",
        "FKP",
        "GBP",
        "GEL",
        "GHS",
        "GIP",
        "GMD",
        "GNF",
        "GTQ",
        "GYD",
        "HKD",
        "HNL",
        "HTG",
        "HUF",
        "IDR",
        "ILS",
        "INR",
        "IQD",
        "IRR",
        "ISK",
        "JMD",
        "JOD",
        "JPY",
        "KES",
        "KGS",
        "KHR",
        "KMF",
        "KPW",
        "KRW",
        "KWD",
        "KYD",
        "KZT",
        "LAK",
        "LBP",
        "LKR",
        "LRD",
        "LSL",
        "LYD",
        "MAD",
        "MDL",
        "MGA",
        "MKD",
        "MMK",
        "MNT",
        "MOP",
        "MRU",
        "MUR",
        "MVR",
        "MWK",
        "MXN",
        "MYR",
        "MZN",
        "NAD",
        "NGN",
        "NIO",
        "NOK",
        "NPR",
        "NZD",
        "OMR",
        "PAB",
        "PEN",
        "PGK",
        "PHP",
        "PKR",
        "PLN",
        "PYG",
        "QAR",
        "RON",
        "RSD",
        "RUB",
        "RWF",
        "SAR",
        "SBD",
        "SCR",
        "SDG",
        "SEK",
        "SGD",
        "SHP",
        "SLE",
        "SOS",
        "SRD",
        "SSP",
        "STN",
        "SVC",
        "SYP",
        "SZL",
        "THB",
        "TJS",
        "TMT",
        "TND",
        "TOP",
        "TRY",
        "TTD",
        "TWD",
        "TZS",
        "UAH",
        "UGX",
        "USD",
        "UYU",
        "UZS",
        "VED",
        "VES",
        "VND",
        "VUV",
        "WST",
        "XAF",
        "XCD",
        "XCG",
        "XOF",
        "XPF",
        "YER",
        "ZAR",
        "ZMW",
        "ZWG",
    }
)


class Price(CamelModel):
    """`spec.price` of a GpuPackage: what one slice costs per hour held."""

    #: A decimal string ("0.45"), never a float: money is counted exactly.
    per_hour: str = Field(alias="perHour", pattern=PER_HOUR_PATTERN)
    #: ISO 4217 code, e.g. EUR, USD.
    currency: str
    #: Sharing mode Kueue only: the price of a slice held on quota Kueue lent from the cohort (an
    #: interval marked borrowed); None: borrowed slices cost `per_hour` too.
    borrowed_per_hour: str | None = Field(default=None, alias="borrowedPerHour", pattern=PER_HOUR_PATTERN)

    def rate(self, borrowed: bool) -> str:
        """The price per hour of a slice held within its entitlement, or borrowed."""
        return self.borrowed_per_hour if borrowed and self.borrowed_per_hour is not None else self.per_hour

    @field_validator("currency")
    @classmethod
    def _iso_4217(cls, v: str) -> str:
        if v not in CURRENCIES:
            raise ValueError(f"currency {v!r} is not an ISO 4217 code of a currency, like EUR or USD")
        return v


class UsageInterval(CamelModel):
    """One slice held without a break in one month at one price: from its claim's allocation (or the
    month's start, or a price change) to its deallocation or deletion (or the month's end)."""

    package: str
    slice: str
    claim: str
    claim_uid: str = Field(alias="claimUID")
    pod: str = ""
    node: str = ""
    gpu: str = ""
    #: Every card of a multi-GPU product, in its claim's order (`gpu` is the first); absent for a
    #: slice of one card.
    gpus: list[str] | None = None
    #: RFC 3339, UTC, whole seconds.
    start: str
    #: None while the slice is held.
    end: str | None = None
    price_per_hour: str | None = Field(default=None, alias="pricePerHour")
    #: The package's price.borrowedPerHour in force: the rate while `borrowed` (absent: pricePerHour).
    borrowed_price_per_hour: str | None = Field(default=None, alias="borrowedPricePerHour")
    currency: str | None = None
    #: A template GpuSlice's per-pod claim (its usage is not read into the ledger).
    template: bool = False
    #: Right-sizing, from the node agent's status.usage readings while the interval was open.
    peak_memory_bytes: int = Field(default=0, alias="peakMemoryBytes")
    memory_limit_bytes: int = Field(default=0, alias="memoryLimitBytes")
    mean_utilization_percent: float = Field(default=0.0, alias="meanUtilizationPercent")
    #: Seconds of readings the mean is over (0: no reading, e.g. a template slice or no process yet).
    observed_seconds: int = Field(default=0, alias="observedSeconds")
    #: The claim's refused allocations since its allocation (the agent's running count), as of the end.
    refused_allocations: int = Field(default=0, alias="refusedAllocations")
    #: Held on quota Kueue lent from the cohort, above the namespace's entitlement (sharing mode
    #: Kueue); absent: within the entitlement.
    borrowed: bool | None = None
    #: Cards the product takes from the fleet: a `gpus: N` product N, a software slice fraction / 100
    #: of a card, a MIG instance its compute slices / 7 (`domain.multigpu.cards_held`).
    cards: float | None = None
    #: Seconds held times cards (an open interval: up to the object's confirmedAt).
    card_seconds: float | None = Field(default=None, alias="cardSeconds")


class PackageTotals(CamelModel):
    package: str
    slice_seconds: int = Field(alias="sliceSeconds")
    peak_slices: int = Field(alias="peakSlices")
    intervals: int
    #: Of sliceSeconds, those held on quota borrowed through Kueue (absent: none).
    borrowed_slice_seconds: int | None = Field(default=None, alias="borrowedSliceSeconds")
    #: Slice-seconds weighted by the cards each slice holds (absent: no interval's cards are known).
    card_seconds: float | None = Field(default=None, alias="cardSeconds")
    #: Decimal strings per currency ("EUR": "1.125"); empty when the package has no price.
    cost: dict[str, str] = Field(default_factory=dict)


class GpuUsage(CamelModel):
    """The object's own fields (top level, like an Event's: a record, not desired state)."""

    month: str = Field(pattern=r"^[0-9]{4}-[0-9]{2}$")
    shard: int = 0
    #: The month ended and the operator closed it: never written again.
    final: bool = False
    #: Until when the operator saw every open interval's claim still allocated (an interval whose
    #: claim vanished while no operator ran is closed here).
    confirmed_at: str | None = Field(default=None, alias="confirmedAt")
    intervals: list[UsageInterval] = Field(default_factory=list)
    # --- shard 0 only: the month's totals over every shard -----------------------------------------
    packages: list[PackageTotals] = Field(default_factory=list)
    slice_hours: str | None = Field(default=None, alias="sliceHours")
    card_hours: str | None = Field(default=None, alias="cardHours")
    cost: str | None = None
    interval_count: int | None = Field(default=None, alias="intervalCount")


def object_name(month: str, shard: int) -> str:
    return month if shard == 0 else f"{month}-{shard}"
