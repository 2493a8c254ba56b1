"""The fleet at a glance during a run: one table of workers and one line about the run.

    python -m bridge.status --workdir=/tmp/run            # reads controller.json + join_token
    python -m bridge.status --controller=https://host:8470 --token_file=join_token [--watch=5]

Reads `GET /v1/status` (read-only; the join secret is the bearer) and prints each worker's
state (active, standby, too_slow, quarantined, gone), policy version, rollouts/s, price,
cost so far and last contact, then the run's step, staleness, spend and whether it is over.
`--all` also lists workers that are gone. Exit status 1 when the controller cannot be read.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

_COLUMNS = (  # header, key, format
    ("worker", "worker_id", "{}"),
    ("name", "name", "{}"),
    ("state", "state", "{}"),
    ("version", "version", "{}"),
    ("rollouts/s", "rollouts_per_s", "{:.2f}"),
    ("$/h", "price_per_hour", "{:.2f}"),
    ("cost $", "cost_usd", "{:.4f}"),
    ("last contact", "last_contact_s", "{:.0f}s ago"),
)


def fetch_status(url: str, secret: str, verify=True) -> dict:
    import httpx

    r = httpx.get(
        url.rstrip("/") + "/v1/status",
        headers={"Authorization": f"Bearer {secret}"},
        verify=verify,
        timeout=30,
    )
    if r.status_code != 200:
        raise RuntimeError(f"{url}/v1/status answered {r.status_code}: {r.text[:200]}")
    return r.json()


def format_status(status: dict, show_gone: bool = False) -> str:
    """The table and the run line, as printed."""
    workers = [w for w in status["workers"] if show_gone or w["state"] != "gone"]
    rows = [[h for h, _, _ in _COLUMNS]]
    rows += [[fmt.format(w[key]) for _, key, fmt in _COLUMNS] for w in workers]
    widths = [max(len(r[i]) for r in rows) for i in range(len(_COLUMNS))]
    lines = ["  ".join(c.ljust(n) for c, n in zip(r, widths, strict=True)).rstrip() for r in rows]
    run = status["run"]
    counts = ", ".join(f"{n} {s}" for s, n in run["workers"].items() if n)
    now = run["staleness_now"]
    lines += [
        "",
        f"step {run['step']}  policy version {run['policy_version']}  staleness "
        f"{'-' if now is None else now}/{run['staleness_bound']}  "
        f"spend ${run['spend_usd']:.4f} (now ${run['spend_usd_per_hour']:.2f}/h)  "
        f"rollouts/s {status.get('fleet/rollouts_per_s', 0.0):.2f}"
        + ("  RUN OVER" if run["run_over"] else ""),
        f"workers: {counts or 'none'}",
    ]
    return "\n".join(lines)


def _target(args) -> tuple[str, str]:
    url, token_file = args.controller, args.token_file
    if args.workdir:
        if not url:
            with open(os.path.join(args.workdir, "controller.json")) as f:
                url = json.load(f)["url"]
        token_file = token_file or os.path.join(args.workdir, "join_token")
    if not url or not token_file:
        raise SystemExit("pass --workdir, or --controller and --token_file")
    with open(token_file) as f:
        return url, f.read().strip()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bridge.status", description=__doc__.split("\n")[0])
    p.add_argument("--workdir", help="the run's workdir (controller.json, join_token)")
    p.add_argument("--controller", help="controller URL (instead of --workdir)")
    p.add_argument("--token_file", help="join secret file; default <workdir>/join_token")
    p.add_argument("--tls_ca_file", default="", help="CA bundle for an https controller")
    p.add_argument("--watch", type=float, default=0.0, help="refresh every N s; 0 = once")
    p.add_argument("--all", action="store_true", help="also list workers that are gone")
    p.add_argument("--json", action="store_true", help="print the raw status JSON")
    args = p.parse_args(argv)
    url, secret = _target(args)
    while True:
        try:
            status = fetch_status(url, secret, args.tls_ca_file or True)
        except Exception as e:  # noqa: BLE001 - one clear line instead of a traceback
            print(f"cannot read {url}: {type(e).__name__}: {e}", file=sys.stderr)
            return 1
        print(json.dumps(status, indent=1) if args.json else format_status(status, args.all))
        if args.watch <= 0:
            return 0
        time.sleep(args.watch)
        print(flush=True)


def cli() -> None:
    """`echo2-status` (pyproject's scripts): the same as `python -m bridge.status`."""
    sys.exit(main())


if __name__ == "__main__":
    cli()
