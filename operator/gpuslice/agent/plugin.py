"""The kubelet DRA plugin: DRA v1 gRPC service and plugin registration, each on its own unix socket.

kubelet's plugin watcher finds `<registry-dir>/gpuslice.io-reg.sock`, calls GetInfo, learns the DRA
endpoint (`<plugins-dir>/gpuslice.io/dra.sock`) and the service version it speaks (`v1.DRAPlugin`),
and then calls NodePrepareResources / NodeUnprepareResources there.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import grpc

from gpuslice import constants as c
from gpuslice import logs
from gpuslice.agent.prepare import PrepareError, Preparer, prepare_many
from gpuslice.agent.proto import dra_v1_pb2 as dra
from gpuslice.agent.proto import dra_v1_pb2_grpc as dra_grpc
from gpuslice.agent.proto import pluginregistration_v1_pb2 as reg
from gpuslice.agent.proto import pluginregistration_v1_pb2_grpc as reg_grpc

log = logs.get(__name__)

PLUGIN_TYPE: Final = "DRAPlugin"
#: k8s.io/kubelet/pkg/apis/dra/v1.DRAPluginService
DRA_SERVICE_VERSION: Final = "v1.DRAPlugin"


def dra_socket_path(plugins_dir: Path) -> Path:
    return plugins_dir / c.DRIVER_NAME / "dra.sock"


def registration_socket_path(registry_dir: Path) -> Path:
    return registry_dir / f"{c.DRIVER_NAME}-reg.sock"


class DRAService(dra_grpc.DRAPluginServicer):
    def __init__(self, preparer: Preparer) -> None:
        self._preparer = preparer

    async def NodePrepareResources(
        self, request: dra.NodePrepareResourcesRequest, context: grpc.aio.ServicerContext
    ) -> dra.NodePrepareResourcesResponse:
        results = await prepare_many(
            self._preparer, [(cl.namespace, cl.name, cl.uid) for cl in request.claims]
        )
        response = dra.NodePrepareResourcesResponse()
        for uid, result in results.items():
            entry = response.claims[uid]
            if isinstance(result, str):
                entry.error = result
                continue
            for device in result:
                entry.devices.append(
                    dra.Device(
                        request_names=[device.request] if device.request else [],
                        pool_name=device.pool,
                        device_name=device.device,
                        cdi_device_ids=device.cdi_device_ids,
                    )
                )
        return response

    async def NodeUnprepareResources(
        self, request: dra.NodeUnprepareResourcesRequest, context: grpc.aio.ServicerContext
    ) -> dra.NodeUnprepareResourcesResponse:
        response = dra.NodeUnprepareResourcesResponse()
        for claim in request.claims:
            try:
                await self._preparer.unprepare(claim.uid)
                response.claims[claim.uid].CopyFrom(dra.NodeUnprepareResourceResponse())
            except (OSError, PrepareError) as exc:  # PrepareError: the driver kept a MIG instance in use
                response.claims[claim.uid].error = f"cleaning up claim {claim.namespace}/{claim.name}: {exc}"
        return response


class RegistrationService(reg_grpc.RegistrationServicer):
    def __init__(self, endpoint: Path) -> None:
        self._endpoint = endpoint
        self.registered: bool | None = None

    async def GetInfo(self, request: reg.InfoRequest, context: grpc.aio.ServicerContext) -> reg.PluginInfo:
        return reg.PluginInfo(
            type=PLUGIN_TYPE,
            name=c.DRIVER_NAME,
            endpoint=str(self._endpoint),
            supported_versions=[DRA_SERVICE_VERSION],
        )

    async def NotifyRegistrationStatus(
        self, request: reg.RegistrationStatus, context: grpc.aio.ServicerContext
    ) -> reg.RegistrationStatusResponse:
        self.registered = request.plugin_registered
        if request.plugin_registered:
            log.info("registered with kubelet")
        else:
            log.error("kubelet rejected the plugin registration", error=request.error)
        return reg.RegistrationStatusResponse()


@dataclass
class PluginServers:
    dra: grpc.aio.Server
    registration: grpc.aio.Server
    dra_socket: Path
    registration_socket: Path
    registration_service: RegistrationService

    async def stop(self, grace: float = 2.0) -> None:
        # unregister first: kubelet notices the registration socket vanish
        await self.registration.stop(grace)
        await self.dra.stop(grace)
        for path in (self.registration_socket, self.dra_socket):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


async def _serve_on(path: Path, add: object) -> grpc.aio.Server:
    path.parent.mkdir(parents=True, exist_ok=True)
    # a socket left by a killed agent would make bind fail
    path.unlink(missing_ok=True)  # noqa: ASYNC240 - one syscall before serving
    server = grpc.aio.server()
    add(server)  # type: ignore[operator]
    if server.add_insecure_port(f"unix://{path}") == 0:
        raise OSError(f"cannot listen on unix socket {path}")
    await server.start()
    return server


async def start(preparer: Preparer, plugins_dir: Path, registry_dir: Path) -> PluginServers:
    dra_sock = dra_socket_path(plugins_dir)
    reg_sock = registration_socket_path(registry_dir)
    dra_server = await _serve_on(
        dra_sock, lambda s: dra_grpc.add_DRAPluginServicer_to_server(DRAService(preparer), s)
    )
    registration = RegistrationService(dra_sock)
    reg_server = await _serve_on(
        reg_sock, lambda s: reg_grpc.add_RegistrationServicer_to_server(registration, s)
    )
    log.info("kubelet plugin serving", dra_socket=str(dra_sock), registration_socket=str(reg_sock))
    return PluginServers(dra_server, reg_server, dra_sock, reg_sock, registration)
