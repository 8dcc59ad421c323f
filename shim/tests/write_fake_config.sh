#!/usr/bin/env bash
# Write a GPU description for the driver test double: N Tesla V100-PCIE-32GB on a driver of branch
# DRIVER (535: CUDA 12.2, the default; 580: CUDA 13.0), as gpuslice_dev.gpusim.simulate.DRIVERS.
#   write_fake_config.sh PATH [N] [DRIVER]
set -euo pipefail
path=${1:?usage: write_fake_config.sh PATH [N] [DRIVER]}
n=${2:-1}
case ${3:-535} in
535) driver=535.183.01 cuda=12020 ;;
580) driver=580.95.05 cuda=13000 ;;
*) echo "write_fake_config.sh: unknown driver branch ${3}; 535 or 580" >&2; exit 2 ;;
esac
{
    echo "version=1"
    echo "driver_version=$driver"
    echo "cuda_driver_version=$cuda"
    for ((i = 0; i < n; i++)); do
        echo "gpu.$i.name=Tesla V100-PCIE-32GB"
        printf 'gpu.%d.uuid=GPU-%08x-0000-4000-8000-%012x\n' "$i" "$((0x5117ce + i))" "$((i + 1))"
        echo "gpu.$i.memory_bytes=34359738368"
        echo "gpu.$i.compute_capability=7.0"
        echo "gpu.$i.multiprocessors=80"
        printf 'gpu.%d.pci_bus_id=00000000:%02X:00.0\n' "$i" "$((4 + i))"
        echo "gpu.$i.pci_device_id=1DB610DE"
        echo "gpu.$i.minor=$i"
    done
} > "$path"
