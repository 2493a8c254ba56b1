"""Rollout workers rented through SkyPilot (`fleet.provisioner=skypilot`): any cloud it knows.

The fleet is a list of worker profiles (`fleet.skypilot_fleet`, a JSON file, e.g.
configs/fleets/skypilot_l4_a100.json):

    {"profiles": [
      {"name": "l4-spot", "accelerator": "L4", "count": 4, "use_spot": true,
       "max_price_per_hour": 0.40},
      {"name": "a100", "accelerator": "A100", "count": 2, "cloud": "gcp",
       "region": "us-central1", "price_per_hour": 3.67}]}

Each profile becomes one provisioner (a dead worker is replaced by its own kind; the
provisioners share `<workdir>/provisioner.jsonl`); each worker is one SkyPilot cluster
`echo2-<name>` running one task (`task_config`):

    workdir      this project's source (synced by SkyPilot to the machine)
    setup        pip install ".[worker-gpu]"
    run          python -m rollout_gpu.worker --controller=URL --token_file=~/.echo2/join_token
                 --name=<name> --price_per_hour=... --accelerator=... --relay_host=0.0.0.0 ...
    file_mounts  the worker's own credential -> ~/.echo2/join_token (and a TLS CA, if any)
    resources    accelerators {A: n}, use_spot, infra cloud/region, the relay's port

Launch, status and teardown go through SkyPilot's Python SDK (`SkyPilotAPI`: `sky.launch`
is submitted without waiting, so the fleet follower is not blocked while a machine
provisions; `sky.status` once per poll for all clusters; `sky.down`). The clusters also
autostop-and-down `autodown_idle_minutes` after their job ends (a learner that died
cannot leak machines for long).

Lifecycle: a cluster that SkyPilot no longer reports UP or INIT after its launch finished
(a preempted spot machine, or one stopped behind our back) is a dead worker with exit
code `PREEMPTED` (75, EX_TEMPFAIL); a launch request that failed is exit code 1. The
controller sees the worker go silent (`gone`), its leases expire and are requeued, and
the fleet follower (learner_jax/rl/fleet.py, bridge/fleet/reconcile.py) starts one
replacement of the same profile, within the profile's count and price cap.

Prices: where SkyPilot's catalog is on this machine (~/.sky/catalogs, fetched by any
earlier `sky` command; nothing is downloaded here) the cheapest matching offer's hourly
price (spot or on-demand) is the profile's price; else the profile's `price_per_hour`.
A profile whose price is over its `max_price_per_hour` is refused before anything starts.
The same prices go to the planner: `python -m bridge.fleet.skypilot --plan=F --plan_out=G`
re-prices a `bridge.plan` fleet's worker types named like profiles.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
import os
import shlex
from typing import Any

from bridge.fleet.provisioner import Limits, Provisioner, WorkerHandle

PREEMPTED = 75  # EX_TEMPFAIL: the machine went away; a replacement may succeed
LAUNCH_FAILED = 1
REMOTE_TOKEN = "~/.echo2/join_token"
REMOTE_CA = "~/.echo2/ca.pem"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclasses.dataclass(frozen=True)
class SkyProfile:
    """One kind of rented worker; `count` of them at once."""

    name: str
    accelerator: str  # SkyPilot's name: "L4", "A100", "A100-80GB", "H100"...
    count: int = 1
    accelerators_per_worker: int = 1
    use_spot: bool = False
    cloud: str = ""  # "" = any cloud SkyPilot may use
    region: str = ""
    price_per_hour: float = 0.0  # used when the catalog is not on this machine
    max_price_per_hour: float = 0.0  # the cap (0 = none)
    max_num_seqs: int = 64
    dtype: str = "bfloat16"

    def __post_init__(self):
        if not self.name or not self.name.replace("-", "").isalnum():
            raise ValueError(f"profile name must be letters, digits and '-', got {self.name!r}")
        if not self.accelerator:
            raise ValueError(f"profile {self.name}: accelerator is required")
        if self.count < 0 or self.accelerators_per_worker < 1:
            raise ValueError(f"profile {self.name}: count >= 0, accelerators_per_worker >= 1")
        if self.price_per_hour < 0 or self.max_price_per_hour < 0:
            raise ValueError(f"profile {self.name}: prices must be >= 0")

    @property
    def infra(self) -> str:
        """SkyPilot's `infra` string: cloud, cloud/region, */region or ''."""
        if self.region:
            return f"{self.cloud or '*'}/{self.region}"
        return self.cloud


def load_profiles(path: str) -> list[SkyProfile]:
    """The profiles of a fleet JSON file; an unknown key is an error (a typo'd cap would
    otherwise be silently ignored)."""
    with open(path) as f:
        data = json.load(f)
    rows = data.get("profiles") if isinstance(data, dict) else None
    if not isinstance(rows, list) or not rows:
        raise ValueError(f"{path}: expected {{'profiles': [ ... ]}} with at least one profile")
    known = {f.name for f in dataclasses.fields(SkyProfile)}
    out = []
    for row in rows:
        extra = set(row) - known
        if extra:
            raise ValueError(
                f"{path}: unknown profile keys {sorted(extra)} (known: {sorted(known)})"
            )
        out.append(SkyProfile(**row))
    if len({p.name for p in out}) != len(out):
        raise ValueError(f"{path}: profile names must be distinct")
    return out


@dataclasses.dataclass(frozen=True)
class TaskOptions:
    """What every worker task shares (the run's side)."""

    controller_url: str
    token_file: str  # on this machine; mounted at REMOTE_TOKEN
    source_dir: str = ROOT  # the project, synced as the task's workdir
    install: str = 'pip install --upgrade pip && pip install ".[worker-gpu]"'
    relay_port: int = 8790
    max_model_len: int = 512
    tls_ca_file: str = ""
    extra_flags: tuple[str, ...] = ()


def worker_command(profile: SkyProfile, name: str, price: float, opts: TaskOptions) -> str:
    flags = [
        f"--controller={opts.controller_url}",
        f"--token_file={REMOTE_TOKEN}",
        f"--name={name}",
        f"--price_per_hour={price:g}",
        f"--accelerator={profile.accelerator}",
        f"--region={profile.region or profile.cloud}",
        f"--max_num_seqs={profile.max_num_seqs}",
        f"--max_model_len={opts.max_model_len}",
        f"--dtype={profile.dtype}",
        # Peers reach the relay at the address the worker calls the controller from.
        "--relay_host=0.0.0.0",
        f"--relay_port={opts.relay_port}",
        *([f"--tls_ca_file={REMOTE_CA}"] if opts.tls_ca_file else []),
        *opts.extra_flags,
    ]
    # ~ must expand on the remote shell: leave those flags unquoted (they hold no spaces).
    quoted = [f if "~" in f else shlex.quote(f) for f in flags]
    return " ".join(["python -m rollout_gpu.worker", *quoted])


def task_config(profile: SkyProfile, name: str, price: float, opts: TaskOptions) -> dict:
    """The SkyPilot task (its YAML schema, as a dict) that runs worker `name`."""
    resources: dict[str, Any] = {
        "accelerators": {profile.accelerator: profile.accelerators_per_worker},
        "use_spot": profile.use_spot,
        "ports": [opts.relay_port],
    }
    if profile.infra:
        resources["infra"] = profile.infra
    mounts = {REMOTE_TOKEN: os.path.abspath(opts.token_file)}
    if opts.tls_ca_file:
        mounts[REMOTE_CA] = os.path.abspath(opts.tls_ca_file)
    return {
        "name": f"echo2-{name}",
        "workdir": opts.source_dir,
        "resources": resources,
        "file_mounts": mounts,
        "setup": opts.install,
        "run": worker_command(profile, name, price, opts),
    }


def make_task(config: dict):
    """A `sky.Task` from a task config: SkyPilot's own parsing and validation."""
    import sky

    return sky.Task.from_yaml_config(copy.deepcopy(config))  # it consumes the dict it parses


def catalog_price(profile: SkyProfile) -> float | None:
    """Cheapest hourly price of one worker from SkyPilot's catalog files already on this
    machine (None when none is: nothing is downloaded here)."""
    try:
        from sky import catalog
        from sky.catalog import common
    except ImportError:
        return None
    clouds = [profile.cloud.lower()] if profile.cloud else ["aws", "gcp", "azure", "lambda"]
    local = [c for c in clouds if os.path.exists(common.get_catalog_path(f"{c}/vms.csv"))]
    if not local:
        return None
    try:
        offers = catalog.list_accelerators(
            gpus_only=True,
            name_filter=profile.accelerator,
            region_filter=profile.region or None,
            quantity_filter=profile.accelerators_per_worker,
            clouds=local,
            case_sensitive=False,
            all_regions=True,
            require_price=True,
        )
    except Exception as e:  # an unreadable catalog (or pandas missing): the profile's price
        logging.warning("SkyPilot catalog unreadable for %s: %s", profile.name, e)
        return None
    prices = [
        o.spot_price if profile.use_spot else o.price
        for name, rows in offers.items()
        if name.lower() == profile.accelerator.lower()
        for o in rows
    ]
    prices = [p for p in prices if p is not None and math.isfinite(p) and p > 0]
    return min(prices) if prices else None


def profile_price(profile: SkyProfile) -> tuple[float, str]:
    """(hourly price, where it came from); refuses a price over the profile's cap."""
    price, source = catalog_price(profile), "skypilot catalog"
    if price is None:
        price, source = profile.price_per_hour, "profile"
    if profile.max_price_per_hour and price > profile.max_price_per_hour + 1e-12:
        raise ValueError(
            f"profile {profile.name}: {profile.accelerator} costs ${price:.3f}/h ({source}), "
            f"over its cap max_price_per_hour=${profile.max_price_per_hour:.3f}"
        )
    return price, source


class SkyPilotAPI:
    """The SkyPilot SDK calls the provisioner makes (each is a request to a SkyPilot API
    server, local or remote); tests record these calls instead (no cloud account here)."""

    def __init__(self, autodown_idle_minutes: int = 10):
        self.autodown_idle_minutes = autodown_idle_minutes

    def launch(self, task, cluster_name: str) -> str:
        """Submit the launch; returns its request id without waiting for the machine."""
        import sky

        return sky.launch(
            task,
            cluster_name=cluster_name,
            idle_minutes_to_autostop=self.autodown_idle_minutes,
            down=True,
        )

    def launch_failed(self, request_id: str) -> bool:
        import sky

        rows = sky.api_status(request_ids=[request_id])
        state = str(getattr(rows[0], "status", "")).rsplit(".", 1)[-1].upper() if rows else ""
        return state in ("FAILED", "CANCELLED")

    def status(self, cluster_names: list[str]) -> dict[str, str]:
        """{cluster: 'UP' | 'INIT' | 'STOPPED'} of those SkyPilot knows (refreshed)."""
        import sky
        from sky.utils.common import StatusRefreshMode

        rows = sky.get(sky.status(cluster_names=cluster_names, refresh=StatusRefreshMode.AUTO))
        return {r.name: getattr(r.status, "value", str(r.status)) for r in rows}

    def down(self, cluster_name: str) -> None:
        import sky

        sky.get(sky.down(cluster_name))


class SkyPilotProvisioner(Provisioner):
    """The workers of one profile, one SkyPilot cluster each."""

    def __init__(
        self,
        workdir: str,
        profile: SkyProfile,
        options: TaskOptions,
        api: SkyPilotAPI | None = None,
        max_usd_per_hour: float = math.inf,
    ):
        price, self.price_source = profile_price(profile)
        super().__init__(
            workdir,
            price,
            Limits(max_workers=profile.count, max_usd_per_hour=max_usd_per_hour),
            prefix=f"sky-{profile.name}-",
        )
        self.profile, self.options, self.api = profile, options, api or SkyPilotAPI()
        self._status: dict[str, str] = {}

    def task_config(self, name: str) -> dict:
        # The machine gets its own credential, never the join secret (Provisioner.identity).
        token = self.credential_file(name, self.options.token_file)
        opts = dataclasses.replace(self.options, token_file=token)
        return task_config(self.profile, name, self.price_per_hour, opts)

    def _launch(self, name: str) -> dict[str, Any]:
        cluster = f"echo2-{name}"
        request_id = self.api.launch(make_task(self.task_config(name)), cluster)
        return {
            "cluster": cluster,
            "request_id": str(request_id),
            "accelerator": self.profile.accelerator,
            "use_spot": self.profile.use_spot,
            "price_source": self.price_source,
        }

    def _release(self, handle: WorkerHandle) -> None:
        self.api.down(handle.info["cluster"])

    def poll(self) -> list[WorkerHandle]:
        alive = self.alive()
        self._status = self.api.status([h.info["cluster"] for h in alive]) if alive else {}
        return super().poll()

    def _exit_code(self, handle: WorkerHandle) -> int | None:
        state = self._status.get(handle.info["cluster"])
        if state in ("UP", "INIT"):
            handle.info["seen"] = True
            return None
        if handle.info.get("seen"):  # listed before, now stopped or gone: the machine went
            if state is not None:  # a stopped spot machine still holds its disk: give it back
                self.api.down(handle.info["cluster"])
            return PREEMPTED
        # Not listed yet: still provisioning, unless the launch request failed.
        return LAUNCH_FAILED if self.api.launch_failed(handle.info["request_id"]) else None


def make_provisioners(
    profiles: list[SkyProfile],
    workdir: str,
    options: TaskOptions,
    api: SkyPilotAPI | None = None,
    max_usd_per_hour: float = math.inf,
) -> list[SkyPilotProvisioner]:
    return [SkyPilotProvisioner(workdir, p, options, api, max_usd_per_hour) for p in profiles]


def price_plan(plan: dict, profiles: list[SkyProfile]) -> tuple[dict, list[str]]:
    """A planner fleet (python -m bridge.plan --fleet) with each worker type named like a
    profile priced as that profile (SkyPilot's catalog where it is on this machine);
    returns (the new fleet, one line per re-priced type)."""
    by_name, out, lines = {p.name: p for p in profiles}, copy.deepcopy(plan), []
    for w in out.get("workers", []):
        if w.get("name") in by_name:
            price, source = profile_price(by_name[w["name"]])
            lines.append(
                f"{w['name']}: ${w.get('price_per_hour', 0):.2f} -> ${price:.2f}/h ({source})"
            )
            w["price_per_hour"] = price
    return out, lines


def main(argv: list[str] | None = None) -> int:
    """Write each profile's task as a SkyPilot YAML (`sky launch -c NAME FILE` by hand)."""
    import argparse

    import yaml

    ap = argparse.ArgumentParser(prog="python -m bridge.fleet.skypilot", description=main.__doc__)
    ap.add_argument("--fleet", required=True, help="profiles JSON")
    ap.add_argument("--controller", required=True, help="controller URL workers dial")
    ap.add_argument("--token_file", required=True, help="the join secret's file (mounted)")
    ap.add_argument("--out", required=True, help="directory for <profile>.yaml")
    ap.add_argument("--plan", default="", help="a planner fleet JSON to re-price (optional)")
    ap.add_argument("--plan_out", default="", help="where the re-priced planner fleet goes")
    args = ap.parse_args(argv)
    if bool(args.plan) != bool(args.plan_out):
        ap.error("--plan and --plan_out go together")
    os.makedirs(args.out, exist_ok=True)
    opts = TaskOptions(args.controller, args.token_file)
    for p in load_profiles(args.fleet):
        price, source = profile_price(p)
        config = task_config(p, f"{p.name}-0", price, opts)
        make_task(config)  # SkyPilot's own validation before anything is written
        path = os.path.join(args.out, f"{p.name}.yaml")
        with open(path, "w") as f:
            yaml.safe_dump(config, f, sort_keys=False)
        print(f"{path}: {p.count} x {p.accelerator} ${price:.2f}/h ({source})")
    if args.plan:
        with open(args.plan) as f:
            plan, lines = price_plan(json.load(f), load_profiles(args.fleet))
        with open(args.plan_out, "w") as f:
            json.dump(plan, f, indent=1)
        print("\n".join([f"{args.plan_out}:", *lines]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
