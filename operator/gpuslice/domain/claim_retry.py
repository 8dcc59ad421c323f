"""When the operator applies a refused claim (or claim template) of a GpuSlice again."""

from __future__ import annotations

from collections.abc import Iterable

from gpuslice.domain.views import QuotaView

#: A create refused for another reason than quota (an overloaded API server's timeouts, a webhook
#: down) is retried after 1, 2, 4 ... s, at most this long apart: every event of the slice's pods
#: refreshes it, and re-applying on each one only adds load to an API server that is refusing.
REFUSED_RETRY_MAX_SECONDS = 30.0

#: A create refused for quota while the quota already shows room is retried after 0.5, 1, 2 ... s,
#: at most this long apart (see `quota_retry_delay`).
QUOTA_RETRY_MAX_SECONDS = 4.0


def refused_retry_delay(refusals: int) -> float:
    """Seconds to wait before the next create after `refusals` refusals in a row (not for quota)."""
    return 0.0 if refusals == 0 else min(2.0 ** (refusals - 1), REFUSED_RETRY_MAX_SECONDS)


def quota_retry_delay(quota_full: bool, refusals: int) -> float | None:
    """After a create refused for quota: None to wait for the namespace's next quota event, else the
    seconds until the next try by itself.

    quota_full: the quota, as the operator last saw it, shows no room for the slice. Then the slot
    that frees it is a claim that goes, and kube-controller-manager's recount after it is the quota
    event that rechecks the slice: no retry before (a namespace may hold thousands waiting).
    Otherwise the API server refused on a count the operator has already seen replaced: the quota
    event that showed the room came before the refusal, and none may come again before the resync
    (30 s). refusals: how many such refusals in a row; none yet, the quota's event has just shown
    the room and the create goes at once. The delay grows with them, as the operator's view can be
    ahead of the API server's for longer (a second quota that limits the same claims).
    """
    if quota_full:
        return None
    return 0.0 if refusals == 0 else min(0.5 * 2.0 ** (refusals - 1), QUOTA_RETRY_MAX_SECONDS)


def no_room(quotas: Iterable[QuotaView], keys: Iterable[str]) -> bool:
    """Some quota counts one of `keys` (those a slice's claim is charged for) as used up."""
    wanted = list(keys)
    for quota in quotas:
        for key in wanted:
            usage = quota.usage(key)
            if usage is not None and usage[0] >= usage[1]:
                return True
    return False
