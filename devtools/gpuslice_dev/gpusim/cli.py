"""`gpuslice shim ...`: try the shim without Kubernetes, inspect a slice's usage, build it."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from gpuslice.api.quantity import parse_int_quantity


def _memory(value: str) -> int | None:
    if value == "unlimited":
        return None
    try:
        n = parse_int_quantity(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not a memory size like 8Gi, 512Mi or 'unlimited'"
        ) from exc
    if n <= 0:
        raise argparse.ArgumentTypeError("memory must be positive")
    return n


def _share(value: str) -> int:
    if not value.isdigit() or not 1 <= int(value) <= 100:
        raise argparse.ArgumentTypeError(f"compute share must be a whole percent in 1..100, got {value!r}")
    return int(value)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    shim = subparsers.add_parser(
        "shim", help="the CUDA intercept shim: run a command under a slice, inspect usage"
    )
    sub = shim.add_subparsers(dest="shim_command", metavar="SHIM_COMMAND", required=True)

    run = sub.add_parser(
        "run",
        help="run CMD under libgpuslice.so with a memory slice (and the driver test double when simulating)",
        description="Example: gpuslice-dev shim run --memory 8Gi --simulate-gpus '1x Tesla V100-PCIE-32GB' "
        "-- python -c 'import pynvml; ...'",
    )
    run.add_argument("--memory", type=_memory, required=True, help="slice size, e.g. 8Gi, or 'unlimited'")
    run.add_argument(
        "--compute-share", type=_share, default=100, help="percent of the GPU's compute (default 100)"
    )
    run.add_argument(
        "--simulate-gpus", metavar="SPEC", help="use the driver test double, e.g. '1x Tesla V100-PCIE-32GB'"
    )
    run.add_argument(
        "--simulate-driver",
        default="535",
        metavar="BRANCH",
        help="the double's driver branch with --simulate-gpus: 535 (CUDA 12.2, default) or 580 (CUDA 13.0)",
    )
    run.add_argument("--gpu-uuid", help="GPU the slice is on (default: GPU 0)")
    run.add_argument("--usage-dir", type=Path, help="keep the usage region here (default: a temporary dir)")
    run.add_argument(
        "--context-overhead", type=_memory, default=0, help="bytes charged per CUDA context (default 0)"
    )
    run.add_argument("command", nargs=argparse.REMAINDER, metavar="-- CMD", help="the command to run")
    run.set_defaults(func=_run)

    usage = sub.add_parser("usage", help="print a slice's usage region as JSON")
    usage.add_argument("usage_dir", type=Path)
    usage.set_defaults(func=_usage)

    build = sub.add_parser("build", help="build libgpuslice.so and the driver test double (make -C shim)")
    build.set_defaults(func=_build)


def _run(args: argparse.Namespace) -> int:
    from gpuslice_dev.gpusim import runner
    from gpuslice_dev.gpusim.build import ShimBuildError

    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        print("gpuslice-dev shim run: no command; put it after `--`", file=sys.stderr)
        return 2
    try:
        prepared = runner.prepare(
            memory_bytes=args.memory,
            compute_share=args.compute_share,
            simulate_gpus=args.simulate_gpus,
            gpu_uuid=args.gpu_uuid,
            usage_dir=args.usage_dir,
            context_overhead_bytes=args.context_overhead or 0,
            driver=args.simulate_driver,
        )
    except (runner.ShimRunError, ShimBuildError, ValueError) as exc:
        print(f"gpuslice-dev shim run: {exc}", file=sys.stderr)
        return 2
    try:
        return runner.run(prepared, command)
    except runner.ShimRunError as exc:
        print(f"gpuslice-dev shim run: {exc}", file=sys.stderr)
        return 127
    finally:
        shutil.rmtree(prepared.workdir, ignore_errors=True)


def _usage(args: argparse.Namespace) -> int:
    from gpuslice.shim.region import read_usage

    print(json.dumps(read_usage(args.usage_dir).model_dump(), indent=2))
    return 0


def _build(args: argparse.Namespace) -> int:
    from gpuslice_dev.gpusim.build import ShimBuildError, ensure_built

    try:
        built = ensure_built()
    except ShimBuildError as exc:
        print(f"gpuslice-dev shim build: {exc}", file=sys.stderr)
        return 1
    for field, value in vars(built).items():
        print(f"{field}: {value}")
    return 0
