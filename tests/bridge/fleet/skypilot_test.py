"""The SkyPilot provisioner (bridge/fleet/skypilot.py) without a cloud account.

- The 2-profile fleet of configs/fleets/skypilot_l4_a100.json (4x L4 spot, 2x A100 on GCP)
  renders one task per worker that SkyPilot's own parser (`sky.Task.from_yaml_config`, and
  `sky.Task.from_yaml` on the YAML file a user would `sky launch`) accepts, with the
  resources, mounts, setup and worker command asked for.
- Launch, status and teardown: SkyPilot's SDK talks to an API server, which cannot start in
  this venv (it pins uvicorn<0.36, the controller runs 0.55) and would find no enabled
  cloud anyway. So `SkyPilotAPI` runs against SkyPilot's SDK functions replaced by
  recorders that bind every call to the real function's signature (a wrong keyword
  fails here as it would against the server), and the provisioner's lifecycle runs
  against a recorded fleet: a spot machine that disappears is a dead worker
  (`PREEMPTED`), the real controller reports it gone and requeues its lease, and one
  pass of bridge/fleet/reconcile.py starts a replacement of the same profile.
"""

import inspect
import json
import os

import pytest
import yaml

sky = pytest.importorskip("sky")

from bridge.control.protocol import Heartbeat, LeaseRequest, WorkerProfile  # noqa: E402
from bridge.control.trust.identity import identity_of  # noqa: E402
from bridge.fleet import skypilot  # noqa: E402
from bridge.fleet.reconcile import reconcile  # noqa: E402
from tests.controller_helpers import Clock, make  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
FLEET = os.path.join(ROOT, "configs", "fleets", "skypilot_l4_a100.json")
URL = "https://learner.example.org:8470"


@pytest.fixture(autouse=True)
def no_catalog(tmp_path_factory, monkeypatch):
    """Hermetic prices: SkyPilot's catalog dir is an empty one unless a test writes one."""
    from sky.catalog import common

    empty = tmp_path_factory.mktemp("no_catalog")
    monkeypatch.setattr(common, "_ABSOLUTE_VERSIONED_CATALOG_DIR", str(empty))


@pytest.fixture
def token_file(tmp_path):
    path = tmp_path / "join_token"
    path.write_text("secret\n")
    return str(path)


def _provs(tmp_path, token_file, api):
    opts = skypilot.TaskOptions(URL, token_file, max_model_len=1024)
    return skypilot.make_provisioners(skypilot.load_profiles(FLEET), str(tmp_path), opts, api)


class RecordedFleet:
    """The calls `SkyPilotAPI` would make, recorded, and the clusters they would create."""

    def __init__(self):
        self.calls, self.clusters, self.failed = [], {}, set()

    def launch(self, task, cluster_name):
        self.calls.append(("launch", cluster_name, task))
        self.clusters[cluster_name] = "INIT"
        return f"req-{len(self.calls)}"

    def status(self, names):
        self.calls.append(("status", tuple(names)))
        return {n: s for n, s in self.clusters.items() if n in names}

    def down(self, name):
        self.calls.append(("down", name))
        self.clusters.pop(name, None)

    def launch_failed(self, request_id):
        return request_id in self.failed


def test_two_profile_fleet_renders_tasks_skypilot_accepts(tmp_path, token_file):
    l4, a100 = _provs(tmp_path, token_file, RecordedFleet())
    assert (l4.price_per_hour, a100.price_per_hour) == (0.28, 3.67)  # no catalog offline
    assert l4.price_source == "profile"
    tasks = {}
    for prov in (l4, a100):
        config = prov.task_config(prov.prefix + "0")
        path = tmp_path / f"{prov.profile.name}.yaml"
        path.write_text(yaml.safe_dump(config))
        tasks[prov.profile.name] = (skypilot.make_task(config), sky.Task.from_yaml(str(path)))
    for task, from_file in tasks.values():
        a, b = from_file.to_yaml_config(), task.to_yaml_config()
        a.pop("_user_specified_yaml", None), b.pop("_user_specified_yaml", None)
        assert a == b

    task, _ = tasks["l4-spot"]
    (res,) = task.resources
    assert res.accelerators == {"L4": 1} and res.use_spot and res.cloud is None
    assert task.name == "echo2-sky-l4-spot-0" and task.workdir == ROOT
    # The machine gets its own credential (cred:<name> from any address), not the secret.
    assert list(task.file_mounts) == [skypilot.REMOTE_TOKEN]
    mounted = task.file_mounts[skypilot.REMOTE_TOKEN]
    credential = open(mounted).read().strip()
    assert "secret" not in credential and mounted != token_file
    assert identity_of(credential, ["secret"], "198.51.100.4") == "cred:sky-l4-spot-0"
    assert 'pip install ".[worker-gpu]"' in task.setup
    run = task.run.split()
    assert run[:3] == ["python", "-m", "rollout_gpu.worker"]
    for flag in (
        f"--controller={URL}",
        f"--token_file={skypilot.REMOTE_TOKEN}",
        "--name=sky-l4-spot-0",
        "--price_per_hour=0.28",
        "--accelerator=L4",
        "--max_model_len=1024",
        "--relay_host=0.0.0.0",
    ):
        assert flag in run
    assert str(skypilot.TaskOptions.relay_port) in res.ports

    task, _ = tasks["a100"]
    (res,) = task.resources
    assert res.accelerators == {"A100": 1} and not res.use_spot
    assert str(res.cloud) == "GCP" and res.region == "us-central1"
    assert "--max_num_seqs=128" in task.run.split()


def test_worker_flags_are_the_worker_binarys(tmp_path, token_file):
    """Every flag the task passes is one `python -m rollout_gpu.worker` defines."""
    from absl import flags

    import rollout_gpu.worker  # noqa: F401  (defines the flags)

    (l4, _) = _provs(tmp_path, token_file, RecordedFleet())
    names = {f.split("=")[0][2:] for f in l4.task_config("x")["run"].split()[3:]}
    assert names <= set(flags.FLAGS), names - set(flags.FLAGS)


def test_bad_profiles_refused_before_anything_starts(tmp_path, token_file):
    fleet = json.load(open(FLEET))
    fleet["profiles"][0]["max_price_per_hour"] = 0.2  # under its price 0.28
    bad = tmp_path / "fleet.json"
    bad.write_text(json.dumps(fleet))
    opts = skypilot.TaskOptions(URL, token_file)
    api = RecordedFleet()
    with pytest.raises(ValueError, match="over its cap"):
        skypilot.make_provisioners(skypilot.load_profiles(str(bad)), str(tmp_path), opts, api)
    fleet["profiles"][0]["max_price"] = 1.0  # a typo'd key
    bad.write_text(json.dumps(fleet))
    with pytest.raises(ValueError, match="unknown profile keys"):
        skypilot.load_profiles(str(bad))
    assert api.calls == [] and not (tmp_path / "provisioner.jsonl").exists()


def test_preempted_spot_worker_requeued_and_replaced_within_the_profile(tmp_path, token_file):
    clock = Clock()
    ctl = make(tmp_path, clock, worker_timeout_s=30.0, lease_ttl_s=10.0)
    ctl.publish(0)
    api = RecordedFleet()
    l4, _ = _provs(tmp_path, token_file, api)
    started = l4.start(5, "initial")  # the profile's count is 4: one refused
    assert [h.name for h in started] == [f"sky-l4-spot-{i}" for i in range(4)]
    assert [c[1] for c in api.calls if c[0] == "launch"] == [f"echo2-{h.name}" for h in started]
    assert all(isinstance(c[2], sky.Task) for c in api.calls if c[0] == "launch")
    assert l4.poll() == []  # INIT: provisioning
    for name in api.clusters:
        api.clusters[name] = "UP"
    assert l4.poll() == []
    # The workers register under their names; the first takes a lease.
    ids = {}
    for h in started:
        profile = WorkerProfile(
            accelerator="L4", price_per_hour=0.28, max_concurrent_sequences=64, name=h.name
        )
        with open(tmp_path / "credentials" / h.name) as f:  # what its machine presents
            who = identity_of(f.read().strip(), ["secret"], "198.51.100.4")
        ids[h.name] = ctl.register(profile, identity=who)[0]
    victim = started[0]
    lease = ctl.lease(ids[victim.name], LeaseRequest(worker_version=0, max_groups=1)).lease
    assert ctl.status()["groups/leased"] == 1

    del api.clusters[f"echo2-{victim.name}"]  # the spot machine is preempted
    clock.t += 60.0
    for h in started[1:]:  # the others keep heartbeating
        ctl.heartbeat(ids[h.name], Heartbeat(worker_version=0))
    status = ctl.status()
    rows = {w["name"]: w["state"] for w in status["workers"]}
    assert rows[victim.name] == "gone" and status["groups/leased"] == 0  # lease requeued
    assert status["groups/queued"] >= 1 and lease.groups
    result = reconcile(l4, len(l4.alive()), status["workers"], reason="fleet")
    assert [h.name for h in result.dead] == [victim.name]
    assert victim.exit_code == skypilot.PREEMPTED
    assert [h.name for h in result.started] == ["sky-l4-spot-4"]
    assert len(l4.alive()) == 4 and l4.alive()[-1].price_per_hour == 0.28
    events = [e["event"] for e in l4.log.read()]
    assert events == ["refused"] + ["start"] * 4 + ["dead", "start"]


def test_launch_failure_is_a_dead_worker(tmp_path, token_file):
    api = RecordedFleet()
    l4, _ = _provs(tmp_path, token_file, api)
    (h,) = l4.start(1, "initial")
    del api.clusters[h.info["cluster"]]
    assert l4.poll() == []  # not listed yet, launch still running: alive
    api.failed.add(h.info["request_id"])
    assert l4.poll() == [h] and h.exit_code == skypilot.LAUNCH_FAILED
    l4.stop_all("end")  # nothing alive: no down for a cluster that never came up
    assert not [c for c in api.calls if c[0] == "down"]


def test_sdk_calls_bind_to_skypilots_signatures(monkeypatch):
    """`SkyPilotAPI`'s calls, each bound to the installed SDK function's signature."""
    calls = []

    def recorder(name, result):
        real = getattr(sky, name)

        def call(*args, **kwargs):
            inspect.signature(real).bind(*args, **kwargs)  # TypeError on a wrong call
            calls.append((name, args, kwargs))
            return result(*args, **kwargs) if callable(result) else result

        monkeypatch.setattr(sky, name, call)

    class Row:
        def __init__(self, name, status):
            self.name, self.status = name, status

    from sky.utils import status_lib

    recorder("launch", "launch-req")
    recorder("down", "down-req")
    recorder("status", "status-req")
    recorder("api_status", lambda request_ids: [Row("r", "FAILED")])
    recorder(
        "get",
        lambda rid: [Row("echo2-a", status_lib.ClusterStatus.UP)] if rid == "status-req" else None,
    )
    api = skypilot.SkyPilotAPI(autodown_idle_minutes=7)
    task = sky.Task.from_yaml_config({"run": "true", "resources": {"accelerators": "L4:1"}})
    assert api.launch(task, "echo2-a") == "launch-req"
    assert api.status(["echo2-a"]) == {"echo2-a": "UP"}
    assert api.launch_failed("launch-req")
    api.down("echo2-a")
    assert [c[0] for c in calls] == ["launch", "status", "get", "api_status", "down", "get"]
    assert calls[0][2] == {"cluster_name": "echo2-a", "idle_minutes_to_autostop": 7, "down": True}


def test_training_binary_fleet_config_picks_the_profiles(tmp_path, token_file):
    """`fleet.provisioner=skypilot` in the binary's fleet (learner_jax/local_fleet.py)."""
    from learner_jax import local_fleet

    cfg = local_fleet.FleetConfig(provisioner="skypilot", skypilot_fleet=FLEET)
    provs = local_fleet.make_provisioners(cfg, str(tmp_path), URL, token_file, 0, 6)
    assert [p.profile.name for p in provs] == ["l4-spot", "a100"]
    assert local_fleet.initial_counts(cfg, 6) == [4, 2]
    with pytest.raises(ValueError, match="add up to 6"):
        local_fleet.make_provisioners(cfg, str(tmp_path), URL, token_file, 0, 5)
    with pytest.raises(ValueError, match="skypilot_fleet"):
        local_fleet.make_provisioners(
            local_fleet.FleetConfig(provisioner="skypilot"), str(tmp_path), URL, token_file, 0, 6
        )


COLUMNS = "InstanceType,AcceleratorName,AcceleratorCount,vCPUs,MemoryGiB,Price,SpotPrice"
LAMBDA_CSV = (
    COLUMNS
    + """,Region,GpuInfo
gpu_1x_a100,A100,1.0,30.0,200.0,1.29,,us-east-1,"{GPU}"
gpu_1x_a100,A100,1.0,30.0,200.0,1.49,,us-west-1,"{GPU}"
gpu_2x_a100,A100,2.0,60.0,400.0,2.58,,us-east-1,"{GPU}"
""".replace(
        "{GPU}", "{'Gpus': [{'Name': 'A100', 'Count': 1.0, 'MemoryInfo': {'SizeInMiB': 40960}}]}"
    )
)


def test_prices_from_skypilots_catalog_when_it_is_on_the_machine(tmp_path, monkeypatch):
    """A catalog file in SkyPilot's schema where SkyPilot keeps them (here a temp dir):
    read through SkyPilot's own catalog code, nothing downloaded."""
    pytest.importorskip("pandas")
    from sky.catalog import common

    (tmp_path / "lambda").mkdir()
    (tmp_path / "lambda" / "vms.csv").write_text(LAMBDA_CSV)
    monkeypatch.setattr(common, "_ABSOLUTE_VERSIONED_CATALOG_DIR", str(tmp_path))
    a100 = skypilot.SkyProfile(name="a100", accelerator="A100", cloud="lambda", price_per_hour=9)
    assert skypilot.profile_price(a100) == (1.29, "skypilot catalog")  # the cheapest region
    east = skypilot.SkyProfile(name="e", accelerator="a100", cloud="lambda", region="us-west-1")
    assert skypilot.catalog_price(east) == 1.49
    two = skypilot.SkyProfile(
        name="t", accelerator="A100", cloud="lambda", accelerators_per_worker=2
    )
    assert skypilot.catalog_price(two) == 2.58
    # No spot offers listed: the profile's own price.
    spot = skypilot.SkyProfile(
        name="s", accelerator="A100", cloud="lambda", use_spot=True, price_per_hour=0.9
    )
    assert skypilot.profile_price(spot) == (0.9, "profile")
    capped = skypilot.SkyProfile(
        name="c", accelerator="A100", cloud="lambda", max_price_per_hour=1.0
    )
    with pytest.raises(ValueError, match=r"\$1.290/h \(skypilot catalog\), over its cap"):
        skypilot.profile_price(capped)
    # The planner's fleet, its A100 type re-priced from the catalog; still a valid fleet.
    from bridge.plan import fleet as plan_fleet

    plan = json.load(open(os.path.join(ROOT, "configs", "fleets", "qwen3_8b.json")))
    plan["workers"][3]["name"] = "a100"
    priced, lines = skypilot.price_plan(plan, [a100])
    assert (
        priced["workers"][3]["price_per_hour"] == 1.29
        and plan["workers"][3]["price_per_hour"] == 1.39
    )
    assert lines == ["a100: $1.39 -> $1.29/h (skypilot catalog)"]
    assert [w["price_per_hour"] for w in priced["workers"][:3]] == [0.22, 0.34, 0.79]
    plan_fleet.parse(priced)
    # A cloud with no catalog file here: nothing read, the profile's price.
    gcp = skypilot.SkyProfile(name="g", accelerator="A100", cloud="gcp", price_per_hour=3.67)
    assert skypilot.catalog_price(gcp) is None


def test_cli_writes_tasks_sky_launch_takes(tmp_path, token_file, capsys):
    out = tmp_path / "tasks"
    argv = [f"--fleet={FLEET}", f"--controller={URL}", f"--token_file={token_file}"]
    assert skypilot.main([*argv, f"--out={out}"]) == 0
    opts = skypilot.TaskOptions(URL, token_file)
    for p in skypilot.load_profiles(FLEET):
        path = out / f"{p.name}.yaml"
        assert yaml.safe_load(path.read_text()) == skypilot.task_config(
            p, f"{p.name}-0", p.price_per_hour, opts
        )
        assert sky.Task.from_yaml(str(path)).name == f"echo2-{p.name}-0"
    assert "4 x L4 $0.28/h (profile)" in capsys.readouterr().out
