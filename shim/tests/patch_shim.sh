#!/usr/bin/env bash
# Copy libgpuslice.so with its config path slot rewritten (what gpuslice_dev.gpusim.patch does in Python).
#   patch_shim.sh SRC_SO CONFIG_PATH DEST_SO
set -euo pipefail
python3 - "$1" "$2" "$3" <<'PY'
import os, sys
src, conf, dest = sys.argv[1:]
marker, slot = b"@@GPUSLICE_CONFIG_PATH@@", 4096
data = bytearray(open(src, "rb").read())
start = data.index(marker) + len(marker)
room = slot - len(marker)
path = os.fsencode(conf)
assert len(path) < room, "config path too long"
data[start:start + room] = path + b"\0" * (room - len(path))
open(dest, "wb").write(data)
os.chmod(dest, 0o555)
PY
