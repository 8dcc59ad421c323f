"""A namespace's entitled and held slices per package, as its gpuslice quota's status says them."""

from __future__ import annotations

from gpuslice import constants as c
from gpuslice.domain.entitlement_use import entitlement_use


def test_each_packages_devices_key_gives_its_entitlement_and_what_is_held() -> None:
    hard = {
        c.quota_key("v100-8g"): "4",
        c.quota_key("v100-16g"): "0",
        "requests.gpuslice.io/v100-8g": "4",  # the resources.limits key: the same slices again
    }
    used = {c.quota_key("v100-8g"): "3", "requests.gpuslice.io/v100-8g": "1"}
    assert entitlement_use(hard, used) == {"v100-8g": (4, 3), "v100-16g": (0, 0)}


def test_a_quota_whose_status_is_not_filled_in_yet_says_nothing() -> None:
    # Not an entitlement of 0: kube-apiserver has not written the status.
    assert entitlement_use({}, {}) == {}
    assert entitlement_use({"gpuslice.io/gpuslices": "100"}, {"gpuslice.io/gpuslices": "3"}) == {}
