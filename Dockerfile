# The gpuslice image (operator, node agent, shim installer) for people with Docker:
#
#   docker build -t ghcr.io/gpuslice/gpuslice:0.2.0 .
#
# `make image` builds the same image without a Docker engine (gpuslice_dev.image: mmdebstrap,
# chroot, crane) into build/gpuslice-image.oci.tar. Keep the two in step: the same Debian release
# and packages (minbase + python3 + python3-venv, no recommends), the venv at /opt/gpuslice with the
# wheel and image/requirements.txt installed --no-deps, pip and setuptools removed, the shim at
# /usr/local/gpuslice/lib/libgpuslice.so, user 65532, entrypoint gpuslice.

FROM debian:bookworm-slim AS build
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates gcc libc6-dev make python3 python3-venv \
 && rm -rf /var/lib/apt/lists/*
COPY . /src
# The shim (its build fetches the CUDA/NVML headers from PyPI wheels) and the gpuslice wheel.
RUN make -C /src/shim build/libgpuslice.so \
 && python3 -m venv /opt/gpuslice \
 && /opt/gpuslice/bin/pip install --no-cache-dir "setuptools>=77" wheel \
 && /opt/gpuslice/bin/pip wheel --no-cache-dir --no-deps --no-build-isolation --wheel-dir /wheels /src
ENV SOURCE_DATE_EPOCH=1700000000
RUN rm -rf /opt/gpuslice \
 && python3 -m venv /opt/gpuslice \
 && /opt/gpuslice/bin/pip install --no-cache-dir --no-deps --only-binary=:all: \
      -r /src/image/requirements.txt /wheels/gpuslice-*.whl \
 && /opt/gpuslice/bin/pip uninstall --yes pip setuptools \
 && /opt/gpuslice/bin/python -c 'import gpuslice.cli, kopf, grpc, pynvml, kubernetes_asyncio'

FROM debian:bookworm-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/* \
 && echo 'nonroot:x:65532:65532::/nonexistent:/usr/sbin/nologin' >> /etc/passwd \
 && echo 'nonroot:x:65532:' >> /etc/group
COPY --from=build /opt/gpuslice /opt/gpuslice
COPY --from=build /src/shim/build/libgpuslice.so /usr/local/gpuslice/lib/libgpuslice.so
ENV PATH=/opt/gpuslice/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
LABEL org.opencontainers.image.title=gpuslice \
      org.opencontainers.image.description="gpuslice operator, node agent and shim installer"
USER 65532:65532
WORKDIR /
ENTRYPOINT ["gpuslice"]
