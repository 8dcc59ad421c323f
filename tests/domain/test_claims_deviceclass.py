"""The objects a package and a slice turn into."""

from __future__ import annotations

import yaml

from gpuslice import constants as c
from gpuslice.domain.claims import documented_form_text, protection_patch, slice_claim, slice_claim_template
from gpuslice.domain.deviceclass import desired_fingerprint, device_class
from gpuslice.domain.pod_slices import product_packages, resource_of
from gpuslice.domain.views import claim_view
from support import package_spec

DOCUMENTED_REQUEST = {
    "name": "gpu",
    "exactly": {"deviceClassName": "v100-8g.gpuslice.io", "allocationMode": "ExactCount", "count": 1},
}


def test_slice_claim_has_same_name_documented_form_and_is_owned_by_the_slice() -> None:
    claim = slice_claim("team-a", "llm", "uid-1", "v100-8g")
    assert claim["apiVersion"] == "resource.k8s.io/v1" and claim["kind"] == "ResourceClaim"
    assert (claim["metadata"]["namespace"], claim["metadata"]["name"]) == ("team-a", "llm")
    assert claim["spec"] == {"devices": {"requests": [DOCUMENTED_REQUEST]}}
    assert claim["metadata"]["labels"] == {
        c.LABEL_MANAGED_BY: "gpuslice",
        c.LABEL_PACKAGE: "v100-8g",
        c.LABEL_SLICE: "llm",
    }
    (owner,) = claim["metadata"]["ownerReferences"]
    assert owner == {
        "apiVersion": "gpuslice.io/v1beta1",
        "kind": "GpuSlice",
        "name": "llm",
        "uid": "uid-1",
        "controller": True,
        "blockOwnerDeletion": False,
    }


def test_a_deallocated_slice_claim_gets_the_schedulers_finalizer_back_onto_the_version_seen() -> None:
    made = slice_claim("team-a", "llm", "uid-1", "v100-8g")
    assert (
        protection_patch(claim_view({**made, "metadata": {**made["metadata"], "resourceVersion": "7"}}))
        is None
    )
    # kube-controller-manager deallocated it and took the finalizer off (another's finalizer stays)
    meta = {**made["metadata"], "resourceVersion": "9", "finalizers": ["example.com/keep"]}
    assert protection_patch(claim_view({**made, "metadata": meta})) == [
        {"op": "test", "path": "/metadata/resourceVersion", "value": "9"},
        {"op": "add", "path": "/metadata/finalizers", "value": ["example.com/keep", c.DRA_CLAIM_FINALIZER]},
    ]
    bare = {**made["metadata"], "resourceVersion": "9", "finalizers": []}
    assert protection_patch(claim_view({**made, "metadata": bare}))[-1]["value"] == [c.DRA_CLAIM_FINALIZER]  # type: ignore[index]
    # not while it is being deleted (the API server would refuse a new finalizer anyway) or allocated
    # (kube-scheduler adds it itself), and never on a claim no GpuSlice controls (a template's, a pod's)
    going = {**bare, "deletionTimestamp": "2026-12-05T00:00:00Z"}
    assert protection_patch(claim_view({**made, "metadata": going})) is None
    allocated = {
        **made,
        "metadata": bare,
        "status": {
            "allocation": {
                "devices": {
                    "results": [
                        {"pool": "n0", "device": "gpu-0-0", "request": "gpu", "driver": c.DRIVER_NAME}
                    ]
                }
            }
        },
    }
    assert protection_patch(claim_view(allocated)) is None
    orphan = {k: v for k, v in bare.items() if k != "ownerReferences"}
    assert protection_patch(claim_view({**made, "metadata": orphan})) is None


def test_template_gives_each_generated_claim_the_labels_that_find_its_slice() -> None:
    tmpl = slice_claim_template("team-a", "workers", "uid-2", "v100-8g")
    assert tmpl["kind"] == "ResourceClaimTemplate" and tmpl["metadata"]["name"] == "workers"
    assert tmpl["spec"]["spec"] == {"devices": {"requests": [DOCUMENTED_REQUEST]}}
    assert tmpl["spec"]["metadata"]["labels"][c.LABEL_SLICE_TEMPLATE] == "workers"
    assert tmpl["spec"]["metadata"]["labels"][c.LABEL_PACKAGE] == "v100-8g"


def test_documented_form_text_is_yaml_of_that_form_in_both_layouts() -> None:
    for text in (documented_form_text("v100-8g"), documented_form_text("v100-8g", one_line=True)):
        doc = yaml.safe_load(text)
        assert doc["spec"]["devices"]["requests"] == [DOCUMENTED_REQUEST]
        assert doc["metadata"]["labels"] == {c.LABEL_PACKAGE: "v100-8g"}
    assert "\n" not in documented_form_text(one_line=True)


def test_device_class_selects_driver_package_and_model() -> None:
    dc = device_class("v100-8g", "uid-p", package_spec(25), "gpuslice.io/v100-8g")
    assert dc["metadata"]["name"] == "v100-8g.gpuslice.io"
    assert dc["spec"]["extendedResourceName"] == "gpuslice.io/v100-8g"
    (selector,) = dc["spec"]["selectors"]
    assert selector["cel"]["expression"] == (
        'device.driver == "gpuslice.io" && "package" in device.attributes["gpuslice.io"]'
        ' && device.attributes["gpuslice.io"].package == "v100-8g"'
        ' && device.attributes["gpuslice.io"].productName == "Tesla V100-PCIE-32GB"'
    )
    assert dc["metadata"]["ownerReferences"][0]["kind"] == "GpuPackage"


def test_device_class_escapes_quotes_in_the_model_name() -> None:
    spec = package_spec(25).model_copy(update={"gpu_model": 'Odd "GPU" \\ name'})
    expr = device_class("p", None, spec, None)["spec"]["selectors"][0]["cel"]["expression"]
    assert expr.endswith('.productName == "Odd \\"GPU\\" \\\\ name"')


def test_a_product_is_requestable_by_its_own_name_unless_the_package_says_otherwise() -> None:
    default = package_spec(25)
    renamed = package_spec(25).model_copy(update={"extended_resource_name": "gpuslice.io/v100-quarter"})
    off = package_spec(25).model_copy(update={"extended_resource_name": ""})
    packages = {"v100-8g": default, "v100-q": renamed, "v100-off": off}
    assert product_packages(packages) == {
        "gpuslice.io/v100-8g": "v100-8g",
        "gpuslice.io/v100-quarter": "v100-q",
    }
    assert resource_of("v100-off", packages) is None
    assert "extendedResourceName" not in device_class("v100-off", None, off, None)["spec"]
    # turning it off or renaming changes what the operator compares the DeviceClass with
    assert len({desired_fingerprint("p", default, r) for r in ("gpuslice.io/p", "gpuslice.io/x", None)}) == 3


def test_two_packages_naming_one_resource_leave_it_to_the_one_whose_own_name_it_is() -> None:
    # kube-scheduler would serve a name two DeviceClasses carry from the older class; only one gets it
    thief = package_spec(50).model_copy(update={"extended_resource_name": "gpuslice.io/v100-8g"})
    packages = {"a-first-by-name": thief, "v100-8g": package_spec(25)}
    assert resource_of("v100-8g", packages) == "gpuslice.io/v100-8g"
    assert resource_of("a-first-by-name", packages) is None
    twins = {"b": thief, "a": thief}
    assert (resource_of("a", twins), resource_of("b", twins)) == ("gpuslice.io/v100-8g", None)
