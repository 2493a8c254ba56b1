"""Plan a fleet: which workers to rent, and what the run will cost and how busy it keeps
the learner, by discrete-event simulation (simulate.py) next to the analytic model
(bridge/control/fleet/capacity.py).

    python -m bridge.plan --fleet=configs/fleets/qwen3_8b.json --out=/tmp/plan.json \
        [--staleness=S] [--publish_every=K] [--broadcast=store|chain|tree] [--steps=N] \
        [--seed=N]

Writes PLAN.json (active, cost_usd, wall_s, predicted_utilization, analytic_utilization,
min_staleness, staleness_histogram, dropped_rollouts, cost_per_step_usd, baseline,
cost_ratio, ...) and prints a short table. Exit status 2 on an invalid fleet file, with the
offending field named.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from bridge.plan import fleet as fleet_lib
from bridge.plan import planner


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bridge.plan", description=__doc__.split("\n")[0])
    p.add_argument("--fleet", required=True, help="FLEET.json")
    p.add_argument("--out", required=True, help="PLAN.json to write")
    for name in ("staleness", "publish_every", "steps", "seed"):
        p.add_argument(f"--{name}", type=int, default=None, help=f"override the file's {name}")
    p.add_argument("--broadcast", choices=fleet_lib.BROADCAST_MODES, default=None)
    args = p.parse_args(argv)
    try:
        fleet = fleet_lib.load(args.fleet)
        over = {
            k: getattr(args, k)
            for k in ("staleness", "publish_every", "steps", "seed", "broadcast")
            if getattr(args, k) is not None
        }
        if over:
            # Re-validate the overridden values through the same schema.
            with open(args.fleet) as f:
                raw = json.load(f)
            fleet = fleet_lib.parse({**raw, **over})
    except (fleet_lib.FleetError, OSError) as e:
        print(f"invalid fleet: {e}", file=sys.stderr)
        return 2
    result = planner.plan(fleet)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(planner.table(result))
    print(f"wrote {args.out}")
    return 0


def cli() -> None:
    """`echo2-plan` (pyproject's scripts): the same as `python -m bridge.plan`."""
    sys.exit(main())


if __name__ == "__main__":
    cli()
