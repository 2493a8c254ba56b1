"""Rollout workers started and released by user command templates: any cloud CLI plugs in.

    prov = CommandProvisioner(
        workdir, url, token_file,
        start="gcloud compute instances create echo2-{name} --zone=us-central1-a "
              "--machine-type=g2-standard-8 --metadata=controller={url},secret={secret} "
              "--metadata-from-file=startup-script=worker_startup.sh",
        stop="gcloud compute instances delete echo2-{name} --zone=us-central1-a --quiet",
        status="gcloud compute instances describe echo2-{name} --zone=us-central1-a",
        price_per_hour=0.85, limits=Limits(max_workers=8, max_usd_per_hour=6.0))

Placeholders, each filled in shell-quoted: `{url}` (the controller), `{token_file}` (the
file of this worker's own credential, minted from the join secret for its name: the
machine never sees the secret, and registers as `cred:<name>`), `{secret}` (the credential
itself: it shows in `ps`, prefer the file where the machine can read it), `{name}` (the
worker's name: pass it on as the worker's `--name=` so the status table and the
activation decision can name it), `{workdir}`, and
in `stop`/`status` `{pid}` (the start command's process id). Other braces are left alone,
so `${VAR}` works.

The start command runs in its own process group with its output in
`<workdir>/workers/<name>.log`. Liveness: with a `status` command, its exit status (0 =
alive); without one, the start command's process: running = alive (a command that runs
the worker in the foreground), exit 0 = launched in the background and assumed alive
until the controller reports the worker gone (bridge/fleet/reconcile.py), other = dead.
`stop` runs the stop command and waits for it (`command_timeout_s`).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess

from bridge.fleet.provisioner import Limits, Provisioner, WorkerHandle

_PLACEHOLDER = re.compile(r"\{(url|token_file|secret|name|workdir|pid)\}")


def fill(template: str, values: dict[str, str]) -> str:
    """`template` with the known placeholders replaced by shell-quoted values."""

    def sub(m: re.Match) -> str:
        if m.group(1) not in values:
            raise KeyError(f"placeholder {m.group(0)} is not available in {template!r}")
        return shlex.quote(str(values[m.group(1)]))

    return _PLACEHOLDER.sub(sub, template)


class CommandProvisioner(Provisioner):
    def __init__(
        self,
        workdir: str,
        controller_url: str,
        token_file: str,
        start: str,
        stop: str,
        price_per_hour: float,
        limits: Limits | None = None,
        status: str | None = None,
        prefix: str = "cmd-",
        command_timeout_s: float = 300.0,
    ):
        super().__init__(workdir, price_per_hour, limits, prefix)
        self.start_template, self.stop_template, self.status_template = start, stop, status
        self.timeout_s = command_timeout_s
        self.log_dir = os.path.join(workdir, "workers")
        os.makedirs(self.log_dir, exist_ok=True)
        self.join_secret_file = token_file
        self.values = {"url": controller_url, "workdir": os.path.abspath(workdir)}
        self._procs: dict[str, subprocess.Popen] = {}

    def _values(self, handle_or_name) -> dict[str, str]:
        name = getattr(handle_or_name, "name", handle_or_name)
        credential = self.credential_file(name, self.join_secret_file)
        with open(credential) as f:
            secret = f.read().strip()
        out = {**self.values, "name": name, "token_file": credential, "secret": secret}
        if name in self._procs:
            out["pid"] = str(self._procs[name].pid)
        return out

    def _launch(self, name: str) -> dict:
        cmd = fill(self.start_template, self._values(name))
        log_path = os.path.join(self.log_dir, f"{name}.log")
        with open(log_path, "ab") as log:
            p = subprocess.Popen(
                ["sh", "-c", cmd], stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self._procs[name] = p
        return {"pid": p.pid, "log": log_path}

    def _run(self, template: str, handle: WorkerHandle) -> int:
        cmd = fill(template, self._values(handle))
        with open(os.path.join(self.log_dir, f"{handle.name}.log"), "ab") as log:
            try:
                return subprocess.run(
                    ["sh", "-c", cmd], stdout=log, stderr=subprocess.STDOUT, timeout=self.timeout_s
                ).returncode
            except subprocess.TimeoutExpired:
                return 124

    def _release(self, handle: WorkerHandle) -> None:
        rc = self._run(self.stop_template, handle)
        handle.info["stop_exit_code"] = rc

    def _exit_code(self, handle: WorkerHandle) -> int | None:
        if self.status_template is not None:
            rc = self._run(self.status_template, handle)
            return None if rc == 0 else rc
        rc = self._procs[handle.name].poll()
        return None if rc in (None, 0) else rc
