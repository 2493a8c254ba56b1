"""`python -m bench.controller_load --kill_at_s=T [--workers=2000 --gen_s=20 ...] --out=F.json`

The controller load bench with the controller in its own process (bridge/control/
process.py), killed with SIGKILL `T` seconds into the run and restarted on the same
database and port. The simulated workers retry through the outage (transport errors,
then the same token); a submission whose reply was lost and is answered "duplicate" on
the retry counts as the acceptance it was. The independent SQLite audit then says whether
anything acknowledged was lost or doubled. Per-operation timers are not available (the
controller is in another process); the controller's CPU is its child's, both lives.
"""

from __future__ import annotations

import json
import os
import threading
import time

import psutil

from bench import load_client


class _NoTimer:
    def __init__(self):
        import collections

        self.total, self.count = collections.Counter(), collections.Counter()


def run(args, config, workdir: str, tok_dir: str, codec, db_path: str) -> dict:
    from bench import controller_load
    from bridge.control.http.service import ServerOptions
    from bridge.control.process import ControllerProcess
    from bridge.tasks import make_task

    proc = ControllerProcess(config, workdir, make_task("arithmetic"), codec, ServerOptions())
    proc.start()
    with open(os.path.join(workdir, "join_token")) as f:
        secret = f.read().strip()
    proc.controller.publish(0)
    stop, consumed, steps, cpu = threading.Event(), [], [0], [0.0]

    def child_cpu() -> float:
        try:
            p = psutil.Process(proc.pid)
            return sum(c.cpu_times().user + c.cpu_times().system for c in [p, *p.children()])
        except psutil.Error:
            return 0.0

    def learner():
        while not stop.is_set():
            try:
                batch, _ = proc.controller.wait_batch(steps[0], args.groups_per_step, 0.5)
                if batch is not None:
                    consumed.extend(g.group_id for g in batch)
                    steps[0] += 1
                    proc.controller.publish(steps[0])
            except (EOFError, OSError, AttributeError):  # the controller is down: wait
                time.sleep(0.2)

    cfg = {
        k: getattr(args, k)
        for k in ("workers", "duration_s", "ramp_s", "gen_s", "max_groups", "seed", "timeout_s")
    }
    thread = threading.Thread(target=learner, daemon=True)
    thread.start()
    t0 = time.monotonic()
    procs, outs = load_client.start_client_procs(
        proc.url, secret, tok_dir, cfg, args.client_procs, workdir
    )
    killed = None
    while any(p.is_alive() for p in procs):
        procs[0].join(timeout=1.0)
        if killed is None and time.monotonic() - t0 >= args.kill_at_s:
            cpu[0] += child_cpu()
            k0 = time.monotonic()
            proc.restart()  # SIGKILL, then a new child on the same database and port
            killed = {"at_s": k0 - t0, "restart_s": time.monotonic() - k0}
    wall = time.monotonic() - t0
    cpu[0] += child_cpu()
    stop.set()
    thread.join()
    stats = proc.controller.stats()
    proc.stop()
    clients = load_client.merge([json.load(open(o)) for o in outs])
    result = controller_load.summarize(args, clients, _NoTimer(), stats, wall, steps[0])
    if killed is not None:  # workers resumed: groups accepted by the restarted controller
        back = killed["at_s"] + killed["restart_s"]
        killed["groups_accepted_after"] = sum(n for t, n in clients["submitted"] if t > back)
    result["killed"] = killed
    result["cpu_s"] = {
        "controller": cpu[0],
        "reward_pool": 0.0,  # counted in the controller's children
        "clients": clients["cpu_s"],
        "machine_cores": os.cpu_count(),
        "loadavg_after": os.getloadavg(),
    }
    result["audit"] = controller_load.audit(db_path, clients["accepted"], consumed, args.group_size)
    return result
