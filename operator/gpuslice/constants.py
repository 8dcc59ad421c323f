"""Every name gpuslice shares with the cluster lives here: API group, driver, labels, annotations, paths.

Changing one of these is an API change: CRDs, manifests, samples and the shim's build all agree on them.
"""

from typing import Final

# --- API -------------------------------------------------------------------------------------------
API_GROUP: Final = "gpuslice.io"
API_VERSION: Final = "v1beta1"
GROUP_VERSION: Final = f"{API_GROUP}/{API_VERSION}"
PACKAGE_KIND: Final = "GpuPackage"
PACKAGE_PLURAL: Final = "gpupackages"
SLICE_KIND: Final = "GpuSlice"
SLICE_PLURAL: Final = "gpuslices"
#: The metering ledger: one namespace's slice-hours of one UTC month (written by the operator only).
USAGE_KIND: Final = "GpuUsage"
USAGE_PLURAL: Final = "gpuusages"

# --- DRA -------------------------------------------------------------------------------------------
DRIVER_NAME: Final = "gpuslice.io"
DRA_GROUP: Final = "resource.k8s.io"
DRA_VERSION: Final = "v1"
DRA_GROUP_VERSION: Final = f"{DRA_GROUP}/{DRA_VERSION}"
#: The finalizer kube-scheduler puts on a claim before it allocates it (and kube-controller-manager's
#: resourceclaim controller takes off once the claim is deallocated or deleted).
DRA_CLAIM_FINALIZER: Final = "resource.kubernetes.io/delete-protection"
DEVICE_CLASS_SUFFIX: Final = ".gpuslice.io"
#: The only request name a gpuslice claim may carry (the documented form).
CLAIM_REQUEST_NAME: Final = "gpu"
#: Quota key suffix kube-apiserver uses for device counts of a DeviceClass.
QUOTA_DEVICES_SUFFIX: Final = ".deviceclass.resource.k8s.io/devices"


def device_class_name(package: str) -> str:
    """DeviceClass of a GpuPackage: `<package>.gpuslice.io`."""
    return f"{package}{DEVICE_CLASS_SUFFIX}"


def quota_key(package: str) -> str:
    """ResourceQuota key counting a package's slices: `<class>.deviceclass.resource.k8s.io/devices`."""
    return f"{device_class_name(package)}{QUOTA_DEVICES_SUFFIX}"


#: Products are also requestable as extended resources (`resources.limits: {gpuslice.io/<package>: 1}`,
#: DeviceClass `extendedResourceName`); kube-scheduler then makes the pod a claim of its own.
EXTENDED_RESOURCE_DOMAIN: Final = "gpuslice.io"
#: Every DeviceClass is also requestable by this implicit name + its class name; tenants may not use it.
IMPLICIT_EXTENDED_RESOURCE_PREFIX: Final = "deviceclass.resource.kubernetes.io/"
#: kube-scheduler's annotation on the claim it makes for a pod's extended resources (value "true").
ANNOTATION_EXTENDED_RESOURCE_CLAIM: Final = "resource.kubernetes.io/extended-resource-claim"
#: ResourceQuota keys are `requests.` + the extended resource name (a pod's requests and its claim).
QUOTA_REQUESTS_PREFIX: Final = "requests."


def extended_resource_name(package: str) -> str:
    """A product's default extended resource name: `gpuslice.io/<package>`."""
    return f"{EXTENDED_RESOURCE_DOMAIN}/{package}"


# --- Ownership and bookkeeping -----------------------------------------------------------------------
FIELD_MANAGER: Final = "gpuslice"
LABEL_PREFIX: Final = "gpuslice.io/"
LABEL_MANAGED_BY: Final = "app.kubernetes.io/managed-by"
MANAGED_BY_VALUE: Final = "gpuslice"
LABEL_PACKAGE: Final = "gpuslice.io/package"
LABEL_SLICE: Final = "gpuslice.io/slice"
LABEL_SLICE_TEMPLATE: Final = "gpuslice.io/slice-template"
LABEL_NODE: Final = "gpuslice.io/node"
#: The UTC month (YYYY-MM) a GpuUsage object records.
LABEL_MONTH: Final = "gpuslice.io/month"
#: "true" on a GpuUsage object whose month is final (the operator never reads or writes it again).
LABEL_FINAL: Final = "gpuslice.io/final"
ANNOTATION_PREFIX: Final = "gpuslice.io/"
FINALIZER: Final = "gpuslice.io/finalizer"
#: On a GpuSlice only while pods reserve its claim: deleted then, it stays (Terminating, phase
#: Releasing) until the last of them ends, so a device still held is still shown, and still billed.
FINALIZER_RELEASE: Final = "gpuslice.io/release"
#: Kopf's progress and diff-base storage live under gpuslice's own prefix, not kopf.zalando.org.
KOPF_PROGRESS_PREFIX: Final = "gpuslice.io"
KOPF_DIFFBASE_ANNOTATION: Final = "gpuslice.io/last-handled-configuration"
PEERING_NAME: Final = "gpuslice"
#: GpuSlice status fields the node agent writes (real usage); the operator leaves them alone.
AGENT_STATUS_FIELDS: Final = ("usage",)
#: Label the operator keeps on every namespace an entitlement selects; admission policies bind to it.
LABEL_TENANT: Final = "gpuslice.io/tenant"
#: Name of the gpuslice-owned ResourceQuota of entitlements in each tenant namespace.
QUOTA_NAME: Final = "gpuslice"
#: Name of the second gpuslice-owned ResourceQuota of each tenant namespace: how many GpuSlice objects
#: it may hold. Apart from the entitlements, so that its usage, unknown to kube-controller-manager
#: until it has discovered the CRD, can only ever hold up GpuSlice creates (admission asks usage only
#: of the keys an object would use) and is re-counted without touching the entitlements.
COUNT_QUOTA_NAME: Final = "gpuslice-objects"
#: Its object-count key (kube-controller-manager counts `count/<plural>.<group>` of any resource).
SLICE_COUNT_KEY: Final = f"count/{SLICE_PLURAL}.{API_GROUP}"
#: Default of `--max-gpuslices-per-namespace`.
DEFAULT_MAX_SLICES_PER_NAMESPACE: Final = 100
#: Seconds between two re-counts the operator asks of a GpuSlice-count quota whose usage
#: kube-controller-manager has not computed (see domain.tenancy.count_quota_nudges).
COUNT_QUOTA_NUDGE_SECONDS: Final = 10.0
#: Prefix of the operator's ValidatingAdmissionPolicies and their bindings.
POLICY_PREFIX: Final = "gpuslice-"

# --- Isolation -----------------------------------------------------------------------------------
#: Pod Security Admission labels the operator sets on every tenant namespace.
PSA_PREFIX: Final = "pod-security.kubernetes.io/"
PSA_ENFORCE: Final = "pod-security.kubernetes.io/enforce"
PSA_ENFORCE_VERSION: Final = "pod-security.kubernetes.io/enforce-version"
PSA_WARN: Final = "pod-security.kubernetes.io/warn"
PSA_AUDIT: Final = "pod-security.kubernetes.io/audit"
#: Pod Security levels from weakest to strongest; a tenant namespace is never weaker than baseline.
PSA_LEVELS: Final = ("privileged", "baseline", "restricted")
#: The taint the operator keeps on GPU nodes: only gpuslice claim pods of tenant namespaces (the
#: operator adds the toleration to them) and pods of exempt platform namespaces may tolerate it.
TAINT_GPU_KEY: Final = "gpuslice.io/gpu"
TAINT_GPU_VALUE: Final = "present"
TAINT_GPU_EFFECT: Final = "NoExecute"
#: The admission objects the operator writes and restores: kind -> plural, all in one group/version.
ADMISSION_GROUP: Final = "admissionregistration.k8s.io"
ADMISSION_VERSION: Final = "v1"
ADMISSION_API: Final = f"{ADMISSION_GROUP}/{ADMISSION_VERSION}"
ADMISSION_PLURALS: Final = {
    "ValidatingAdmissionPolicy": "validatingadmissionpolicies",
    "ValidatingAdmissionPolicyBinding": "validatingadmissionpolicybindings",
    "MutatingAdmissionPolicy": "mutatingadmissionpolicies",
    "MutatingAdmissionPolicyBinding": "mutatingadmissionpolicybindings",
}
#: The namespace the manifests install the operator and the agents into.
SYSTEM_NAMESPACE: Final = "gpuslice-system"
#: Nodes carrying this label are GPU nodes (GPU Feature Discovery sets it); `--gpu-node-label`.
GPU_NODE_LABEL: Final = "nvidia.com/gpu.present=true"
#: The namespace name label the API server sets on every namespace (bindings exempt by it).
LABEL_NAMESPACE_NAME: Final = "kubernetes.io/metadata.name"
#: Extended resources that are GPUs outside gpuslice: a tenant pod may not request them. (gpuslice.io/*
#: names are products, admitted in one form only: `domain.admission.pod_products_policy`.)
RAW_GPU_RESOURCE_PREFIXES: Final = ("nvidia.com/", "amd.com/gpu", "gpu.intel.com/")

# --- Node paths (host side) ---------------------------------------------------------------------------
HOST_STATE_DIR: Final = "/var/lib/gpuslice"
HOST_RUN_DIR: Final = "/var/run/gpuslice"
HOST_SHIM_DIR: Final = "/usr/local/gpuslice/lib"
KUBELET_PLUGINS_DIR: Final = "/var/lib/kubelet/plugins"
KUBELET_REGISTRY_DIR: Final = "/var/lib/kubelet/plugins_registry"
CDI_DIR: Final = "/var/run/cdi"
#: where the NVIDIA container toolkit's CDI spec may be (`nvidia-ctk cdi generate` writes
#: /etc/cdi/nvidia.yaml, the GPU Operator /var/run/cdi); a MIG claim's spec takes the driver's
#: libraries from it. Overridden by GPUSLICE_NVIDIA_CDI_DIRS (colon-separated).
NVIDIA_CDI_DIRS: Final = ("/etc/cdi", "/var/run/cdi")
NVIDIA_CDI_DIRS_ENV: Final = "GPUSLICE_NVIDIA_CDI_DIRS"
#: the kernel's /proc, where the agent reads the NVIDIA modules' device majors and MIG minors
#: (overridden by GPUSLICE_PROC_ROOT for a simulated node)
PROC_ROOT: Final = "/proc"
PROC_ROOT_ENV: Final = "GPUSLICE_PROC_ROOT"
#: the kernel's sysfs, where the agent reads each card's PCIe root complex and NUMA node
#: (overridden by GPUSLICE_SYS_ROOT for a simulated node, whose cards the host's sysfs lacks)
SYS_ROOT: Final = "/sys"
SYS_ROOT_ENV: Final = "GPUSLICE_SYS_ROOT"
#: environment default of `gpuslice agent --mig-layout` (dynamic|static)
MIG_LAYOUT_ENV: Final = "GPUSLICE_MIG_LAYOUT"
CDI_VENDOR: Final = "gpuslice.io"
CDI_CLASS: Final = "slice"

# --- Container paths (what the CDI spec injects) ------------------------------------------------------
#: The shim reads its limits from this fixed, read-only path; never from the environment.
CONTAINER_CONFIG_PATH: Final = "/etc/gpuslice/slice.conf"
CONTAINER_USAGE_DIR: Final = "/var/run/gpuslice/slice"
CONTAINER_SHIM_PATH: Final = "/usr/local/gpuslice/lib/libgpuslice.so"
CONTAINER_LD_SO_PRELOAD: Final = "/etc/ld.so.preload"

#: Environment variables a tenant must not set on a container that can reach a GPU node (admission
#: denies them): the NVIDIA container runtime hands out cards by NVIDIA_* variables, and the loader
#: variables would change which driver library the shim wraps.
FORBIDDEN_ENV_VARS: Final = (
    "NVIDIA_VISIBLE_DEVICES",
    "NVIDIA_DRIVER_CAPABILITIES",
    "CUDA_VISIBLE_DEVICES",
    "LD_PRELOAD",
    "LD_LIBRARY_PATH",
    "LD_AUDIT",
)
#: Any variable with one of these prefixes is refused too: every NVIDIA_* variable (the runtime reads
#: several, e.g. NVIDIA_MIG_CONFIG_DEVICES, NVIDIA_REQUIRE_*), gpuslice's and HAMi-style limit names.
#: Plain CUDA_* variables (CUDA_LAUNCH_BLOCKING, CUDA_CACHE_PATH) stay allowed: honest programs use
#: them and none of them reaches another card.
FORBIDDEN_ENV_PREFIXES: Final = ("NVIDIA_", "GPUSLICE_", "CUDA_DEVICE_MEMORY", "CUDA_DEVICE_SM_LIMIT")

# --- Products --------------------------------------------------------------------------------------
GIB: Final = 1024**3
MIB: Final = 1024**2

#: Kueue's scheduling gate on a pod it queues (its pod integration); removed when it admits the pod.
KUEUE_ADMISSION_GATE = "kueue.x-k8s.io/admission"
