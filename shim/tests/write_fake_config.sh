#!/usr/bin/env bash
# Write a GPU description for the driver test double: N Tesla V100-PCIE-32GB.
#   write_fake_config.sh PATH [N]
set -euo pipefail
path=${1:?usage: write_fake_config.sh PATH [N]}
n=${2:-1}
{
    echo "version=1"
    echo "driver_version=535.183.01"
    echo "cuda_driver_version=12020"
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
