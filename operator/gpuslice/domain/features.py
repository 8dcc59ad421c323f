"""Pure: what the API server serves -> which gpuslice features work on this cluster, and why not.

gpuslice leans on Kubernetes features that moved between 1.35, 1.36 and 1.37 (the README's
"Kubernetes versions" table, read from each minor's `pkg/features/kube_features.go`). The API
server says what it serves in discovery; a field whose gate is off is only seen missing from what a
server-side dry-run write returns. `gpuslice.platform` reads both into `PlatformFacts`; `decide`
turns them into one `Feature` per capability, each on or off with the reason and what gpuslice does
instead. The operator (log, GpuPackage condition), the agent (publish or refuse) and
`gpuslice check` all say the same sentences.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

#: Minors the product is tested on (`make test`, `make test-versions`).
SUPPORTED_MINORS: Final = (35, 36, 37)

#: discovery names ("group/version/resource") the features are served under
MUTATING_POLICIES: Final = "admissionregistration.k8s.io/v1/mutatingadmissionpolicies"
VALIDATING_POLICIES: Final = "admissionregistration.k8s.io/v1/validatingadmissionpolicies"
DEVICE_TAINT_RULES: Final = "resource.k8s.io/v1/devicetaintrules"
RESOURCE_SLICES: Final = "resource.k8s.io/v1/resourceslices"

# Feature names (stable: tests and `gpuslice check` name them).
PARTITIONABLE: Final = "partitionable devices"
DEVICE_TAINTS: Final = "device taints"
TAINT_RULES: Final = "DeviceTaintRules"
EXTENDED_RESOURCES: Final = "resources.limits form"
MUTATING: Final = "MutatingAdmissionPolicy"
VALIDATING: Final = "ValidatingAdmissionPolicy"


@dataclass(frozen=True)
class PlatformFacts:
    """What was read from the API server. None: could not be read (denied, or not probed)."""

    git_version: str
    #: every "group/version/resource" discovery lists (for the groups gpuslice uses)
    served: frozenset[str]
    #: ResourceSlice fields a dry-run create came back without (`api.resourceslice.dropped_fields`)
    dropped_slice_fields: tuple[str, ...] | None = None
    #: devices a dry-run create came back without their taints (`api.resourceslice.dropped_taints`)
    dropped_taints: tuple[str, ...] | None = None
    #: a dry-run DeviceClass kept spec.extendedResourceName
    extended_resource_kept: bool | None = None
    #: the bootstrap ClusterRole system:kube-scheduler may read DeviceTaintRules: kube-apiserver adds
    #: that rule only with DRADeviceTaintRules on; discovery lists the GA resource either way
    scheduler_reads_taint_rules: bool | None = None


@dataclass(frozen=True)
class Feature:
    name: str
    gate: str
    on: bool
    #: why it is off (or could not be read), and what gpuslice does instead; "" when on
    reason: str = ""
    #: its absence would break a guarantee: nothing of it may be offered (the agent publishes nothing)
    guarantee: bool = False
    unknown: bool = False


@dataclass(frozen=True)
class Platform:
    version: str
    minor: tuple[int, int] | None
    #: "" when the version is one gpuslice is tested on; else what to tell the operator
    version_problem: str
    features: tuple[Feature, ...] = field(default_factory=tuple)

    def feature(self, name: str) -> Feature:
        return next(f for f in self.features if f.name == name)

    def on(self, name: str) -> bool:
        return self.feature(name).on

    @property
    def off(self) -> list[Feature]:
        return [f for f in self.features if not f.on]

    @property
    def publish_refusal(self) -> str | None:
        """Why the agent must publish no device (a guarantee would break), or None."""
        broken = [f for f in self.off if f.guarantee and not f.unknown]
        if not broken:
            return None
        return "; ".join(f"{f.name} off on Kubernetes {self.version}: {f.reason}" for f in broken)

    def summary(self) -> str:
        """One sentence for a status condition and the operator's log."""
        parts = [self.version_problem] if self.version_problem else []
        parts += [f"{f.name} off ({f.gate}): {f.reason}" for f in self.off]
        if not parts:
            return f"Kubernetes {self.version}: every feature gpuslice uses is served"
        return f"Kubernetes {self.version}: " + "; ".join(parts)


def served_version(info: Mapping[str, Any]) -> str:
    """The version the API server behaves as, from its /version. A server started with
    `--emulated-version` serves the APIs and feature gates of that older minor, whatever its binary:
    its gitVersion alone would call a 1.37 binary emulating 1.34 supported. The emulation fields are
    absent on servers older than 1.31 and on those that emulate nothing new."""
    git = str(info.get("gitVersion") or "unknown")
    major, minor = str(info.get("emulationMajor") or ""), str(info.get("emulationMinor") or "")
    if not (major.isdigit() and minor.rstrip("+").isdigit()):
        return git
    emulated = (int(major), int(minor.rstrip("+")))
    if emulated == parse_minor(git):
        return git
    return f"v{emulated[0]}.{emulated[1]} (emulated by {git})"


def parse_minor(git_version: str) -> tuple[int, int] | None:
    m = re.match(r"v?(\d+)\.(\d+)", git_version)
    return (int(m.group(1)), int(m.group(2))) if m else None


def version_problem(git_version: str) -> str:
    minor = parse_minor(git_version)
    tested = ", ".join(f"1.{m}" for m in SUPPORTED_MINORS)
    if minor is None:
        return f"cannot read the Kubernetes version {git_version!r}; gpuslice is tested on {tested}"
    if minor < (1, SUPPORTED_MINORS[0]):
        return (
            f"Kubernetes {git_version} is older than gpuslice supports ({tested}): upgrade the cluster; "
            "what still works is decided from what the API server serves"
        )
    if minor > (1, SUPPORTED_MINORS[-1]):
        return (
            f"Kubernetes {git_version} is newer than gpuslice was tested on ({tested}); features are "
            "decided from what the API server serves"
        )
    return ""


def _gate_fix(gate: str) -> str:
    return (
        f"turn on the feature gate {gate} (kube-apiserver, kube-controller-manager, kube-scheduler, kubelets)"
    )


def fix(feature: Feature) -> str:
    """What a cluster administrator does to turn `feature` on."""
    if feature.name == TAINT_RULES:
        return "Kubernetes 1.37 serves DeviceTaintRule in resource.k8s.io/v1 (on by default); " + _gate_fix(
            feature.gate
        )
    if feature.name == MUTATING:
        return "Kubernetes 1.36 or newer serves admissionregistration.k8s.io/v1 MutatingAdmissionPolicy"
    if feature.name == VALIDATING:
        return "use Kubernetes 1.30 or newer (admissionregistration.k8s.io/v1 is GA there)"
    return _gate_fix(feature.gate)


def _dropped(fields: Sequence[str] | None, keys: Sequence[str]) -> bool | None:
    if fields is None:
        return None
    return any(f.rsplit(".", 1)[-1] in keys for f in fields)


def decide(facts: PlatformFacts) -> Platform:
    version = facts.git_version
    feats: list[Feature] = []

    counters_dropped = _dropped(facts.dropped_slice_fields, ("sharedCounters", "consumesCounters"))
    gate = "DRAPartitionableDevices"
    if counters_dropped is None:
        feats.append(Feature(PARTITIONABLE, gate, True, "not checked (no dry-run ResourceSlice)", True, True))
    elif counters_dropped:
        feats.append(
            Feature(
                PARTITIONABLE,
                gate,
                False,
                "the API server drops ResourceSlice shared counters, so nothing would stop two slices "
                "being sold on one card's memory: the agent publishes no device; " + _gate_fix(gate)
                + " (beta and on by default from 1.36)",
                guarantee=True,
            )
        )  # fmt: skip
    else:
        feats.append(Feature(PARTITIONABLE, gate, True))

    gate = "DRADeviceTaints"
    if facts.dropped_taints is None:
        feats.append(Feature(DEVICE_TAINTS, gate, True, "not checked", unknown=True))
    elif facts.dropped_taints:
        feats.append(
            Feature(
                DEVICE_TAINTS,
                gate,
                False,
                "the API server drops device taints: an unhealthy card's devices cannot be taken off sale "
                "by a taint, so the agent leaves them out of its ResourceSlices; " + _gate_fix(gate),
            )
        )
    else:
        feats.append(Feature(DEVICE_TAINTS, gate, True))

    gate = "DRADeviceTaintRules"
    taints_off = bool(facts.dropped_taints)
    if DEVICE_TAINT_RULES in facts.served and (taints_off or facts.scheduler_reads_taint_rules is False):
        feats.append(
            Feature(
                TAINT_RULES,
                gate,
                False,
                f"{DEVICE_TAINT_RULES} is served, but the gate is off"
                + (" (it needs DRADeviceTaints)" if taints_off else "")
                + ": kube-scheduler ignores the rules, so `gpuslice drain` would take nothing out of "
                "service; cordon and drain the node instead",
            )
        )
    elif DEVICE_TAINT_RULES in facts.served:
        feats.append(Feature(TAINT_RULES, gate, True))
    else:
        feats.append(
            Feature(
                TAINT_RULES,
                gate,
                False,
                f"{DEVICE_TAINT_RULES} is not served (GA in 1.37): `gpuslice drain` cannot take cards out "
                "of service; cordon and drain the node instead",
            )
        )

    gate = "DRAExtendedResource"
    if facts.extended_resource_kept is None:
        feats.append(Feature(EXTENDED_RESOURCES, gate, True, "not checked", unknown=True))
    elif facts.extended_resource_kept:
        feats.append(Feature(EXTENDED_RESOURCES, gate, True))
    else:
        feats.append(
            Feature(
                EXTENDED_RESOURCES,
                gate,
                False,
                "the API server drops DeviceClass.spec.extendedResourceName: products cannot be asked for "
                "in resources.limits, only through GpuSlices and their claims; " + _gate_fix(gate)
                + " (beta and on by default from 1.36)",
            )
        )  # fmt: skip

    gate = "MutatingAdmissionPolicy"
    if MUTATING_POLICIES in facts.served:
        feats.append(Feature(MUTATING, gate, True))
    else:
        feats.append(
            Feature(
                MUTATING,
                gate,
                False,
                f"{MUTATING_POLICIES} is not served (GA and on from 1.36): the operator does not install "
                "its mutating policies (the GPU nodes' toleration, RuntimeDefault seccomp for slice "
                "pods); tenant pods must carry them themselves, and the validating policies still "
                "refuse what is unsafe",
            )
        )

    if VALIDATING_POLICIES in facts.served:
        feats.append(Feature(VALIDATING, "", True))
    else:
        feats.append(
            Feature(
                VALIDATING,
                "",
                False,
                f"{VALIDATING_POLICIES} is not served: admission cannot keep tenants to the documented "
                "forms; the agent still refuses to prepare a claim of another form",
                guarantee=False,
            )
        )
    return Platform(version, parse_minor(version), version_problem(version), tuple(feats))
