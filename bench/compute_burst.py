"""Work-conserving compute (a package's computeBurst) on the driver double: what a burst slice of
share 25 gets alone on its card, and what a neighbour asking for its 25 % gets 2 s after it starts.

    .venv/bin/python bench/compute_burst.py [--rounds 3] [--json]

For 2 and 4 slices of share 25 on one simulated card (the first bursting), with the node agent's
measurement and allowance loop (gpuslice_dev.gpusim.burst): the burst slice alone (20 ms kernels,
6 s, its second half measured); then the burst slice running and a neighbour starting (10 ms kernels;
the neighbour's probe measures 2 s to 4 s after its start, the agent's figures give the burst slice's
use over the same window). Prints fractions of the card (medians and worst over the rounds).
"""

from __future__ import annotations

import argparse
import json
import statistics

from gpuslice_dev.gpusim import burst


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    result: dict[str, dict[str, list[float]]] = {}
    for n in (2, 4):
        alone, neighbour, after = [], [], []
        for _ in range(args.rounds):
            with burst.card(n) as c:
                alone.append(burst.busy(c.launch(0, 6, 20000)))
            with burst.card(n) as c:
                f = burst.fall_back(c)
            neighbour.append(f.neighbour)
            after.append(f.burst_after / 100)
        result[f"{n} slices"] = {"alone": alone, "neighbour_2_4s": neighbour, "burst_2_4s": after}
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{'':12}{'burst alone':>24}{'neighbour 2-4 s':>24}{'burst 2-4 s':>24}")
    print(f"{'':12}{'median (min)':>24}{'median (min..max)':>24}{'median (max)':>24}")
    for label, r in result.items():
        a, nb, b = r["alone"], r["neighbour_2_4s"], r["burst_2_4s"]
        print(
            f"{label:12}{f'{statistics.median(a):.1%} ({min(a):.1%})':>24}"
            f"{f'{statistics.median(nb):.1%} ({min(nb):.1%}..{max(nb):.1%})':>24}"
            f"{f'{statistics.median(b):.1%} ({max(b):.1%})':>24}"
        )
    print(
        f"(share 25 each, {args.rounds} rounds; promised: alone >= 90 %, neighbour 25 % +-5 points from 2 s)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
