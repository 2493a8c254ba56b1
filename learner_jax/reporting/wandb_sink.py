"""Weights & Biases as a third metrics sink beside metrics.jsonl and TensorBoard.

On when `metrics.wandb.project` is set (`metrics.wandb.entity`, `metrics.wandb.mode`:
"online" | "offline" | "disabled" | "" = wandb's own default, which WANDB_MODE overrides).
What goes to the run:

    config      the whole run config (config.json's content), at init
    history     every metrics.jsonl line, the same keys and values (None = NaN/inf: left out)
    eval        eval.jsonl as the table `eval/table` (one row per held-out evaluation)
    plots       the report's PNGs (reward, utilization, staleness, swap latency, cost)

Resume: the run id is kept in `<workdir>/wandb_run_id`, so a restarted run in the same
workdir continues the same W&B run (`resume="allow"`). A resumed learner rewinds to its
last checkpoint and writes some steps again; W&B refuses a `step=` lower than its last, so
each line is logged under wandb's own counter with the learner's `step` as the charts'
x axis (`define_metric`), and a reader takes the last row of a repeated step, as for
metrics.jsonl.

`read_offline_run(workdir)` reads the offline run files back (the LevelDB-log framing of
the .wandb file decoded here, each record parsed by wandb's own protobuf `Record`): wandb
0.31 ships no Python reader of its own, and this is what the tests compare with
metrics.jsonl.
"""

from __future__ import annotations

import glob
import json
import os
import re
import secrets
import struct
import zlib

from learner_jax.reporting.metrics import read_jsonl

RUN_ID_FILE = "wandb_run_id"
PLOTS = ("reward.png", "utilization.png", "staleness.png", "swap_latency.png", "cost.png")
MODES = ("", "online", "offline", "disabled")


def wandb_options(config) -> dict | None:
    """{project, entity, mode} from `config.metrics.wandb`, or None when W&B is off."""
    metrics = config.get("metrics") if hasattr(config, "get") else None
    w = metrics.get("wandb") if metrics is not None else None
    if w is None or not w.get("project", ""):
        return None
    mode = w.get("mode", "")
    if mode not in MODES:
        raise ValueError(f"metrics.wandb.mode must be one of {MODES}, got {mode!r}")
    return {"project": w.project, "entity": w.get("entity", ""), "mode": mode}


def run_id(workdir: str) -> str:
    """The workdir's W&B run id, generated and kept on the first call."""
    path = os.path.join(workdir, RUN_ID_FILE)
    if os.path.exists(path):
        with open(path) as f:
            rid = f.read().strip()
        if rid:
            return rid
    rid = secrets.token_hex(4)  # W&B ids: [a-z0-9]+, 8 like its own
    with open(path, "w") as f:
        f.write(rid + "\n")
    return rid


class WandbSink:
    """One W&B run per workdir; `write(row)` per metrics line, `report(workdir)` at the end."""

    def __init__(self, workdir: str, project: str, entity: str = "", mode: str = "", config=None):
        import wandb

        self._wandb = wandb
        os.makedirs(workdir, exist_ok=True)
        self.run = wandb.init(
            project=project,
            entity=entity or None,
            mode=mode or None,
            id=run_id(workdir),
            resume="allow",
            dir=workdir,
            name=os.path.basename(os.path.abspath(workdir)),
            config=config,
            # The binary's console (progress bars, step lines) stays as it is; its text is
            # in <workdir>/train.log already.
            settings=wandb.Settings(console="off"),
        )
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def write(self, row: dict) -> None:
        self.run.log({k: v for k, v in row.items() if v is not None})

    def report(self, workdir: str) -> None:
        """The eval table and the summary plots, once the report is written."""
        wandb, out = self._wandb, {}
        evals = read_jsonl(os.path.join(workdir, "eval.jsonl"))
        if evals:
            cols = list(dict.fromkeys(k for row in evals for k in row))
            out["eval/table"] = wandb.Table(
                columns=cols, data=[[row.get(c) for c in cols] for row in evals]
            )
        for name in PLOTS:
            path = os.path.join(workdir, name)
            if os.path.exists(path):
                out[f"plots/{name[: -len('.png')]}"] = wandb.Image(path)
        if out:
            self.run.log(out)

    def close(self) -> None:
        self.run.finish()
        # finish() can return before wandb's service has written the run's last records
        # (seen offline: a resumed segment read back empty); its teardown waits for them.
        self._wandb.teardown()


def sinks_for(config, workdir: str) -> list:
    """The extra sinks the config asks for (W&B today)."""
    opts = wandb_options(config)
    if opts is None:
        return []
    return [WandbSink(workdir, config=config.to_dict(), **opts)]


# -- reading an offline run back ---------------------------------------------------------
_BLOCK, _HEADER = 32768, b":W&B\xe1\xbe\x00"  # LevelDB log blocks; wandb's file header


def _records(path: str):
    """wandb's protobuf `Record`s of one .wandb file, checksums verified."""
    from wandb.proto import wandb_internal_pb2

    with open(path, "rb") as f:
        data = f.read()
    if not data.startswith(_HEADER):
        raise ValueError(f"{path}: not a .wandb file")
    pos, buf = len(_HEADER), b""
    while pos + 7 <= len(data):
        if _BLOCK - pos % _BLOCK < 7:  # a block's tail too short for a header is padding
            pos += _BLOCK - pos % _BLOCK
            continue
        crc, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk = data[pos + 7 : pos + 7 + n]
        pos += 7 + n
        if kind == 0 and n == 0:  # zero fill
            continue
        if zlib.crc32(chunk, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF != crc:
            raise ValueError(f"{path}: bad checksum at byte {pos - 7 - n}")
        buf = chunk if kind in (1, 2) else buf + chunk  # FULL/FIRST start a record
        if kind in (1, 4):  # FULL/LAST end one
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(buf)
            yield rec


def _nested(items) -> dict:
    """History/config items as a dict: a media value's fields come as nested keys."""
    out: dict = {}
    for it in items:
        path = [it.key] if it.key else list(it.nested_key)
        d = out
        for part in path[:-1]:
            d = d.setdefault(part, {})
        d[path[-1]] = json.loads(it.value_json)
    return out


def read_offline_run(workdir: str) -> dict:
    """{"run_id", "config", "history": [row], "media": {key: table rows or media ref}} of
    the workdir's offline W&B run, every resumed segment in order; private keys (`_step`,
    `_runtime`, ...) dropped."""
    if not os.path.exists(os.path.join(workdir, RUN_ID_FILE)):
        raise FileNotFoundError(f"no W&B run in {workdir} ({RUN_ID_FILE} missing)")
    rid = run_id(workdir)
    # One folder per (re)start: offline-run-<time>-<id>, "-1", "-2"... within one second.
    dirs = glob.glob(os.path.join(workdir, "wandb", f"offline-run-*-{rid}*"))
    dirs = [d for d in dirs if re.search(rf"-{rid}(-\d+)?$", d)]
    key = lambda d: (d.rsplit(rid, 1)[0], int(d.rsplit(rid, 1)[1][1:] or 0))
    files = [f for d in sorted(dirs, key=key) for f in glob.glob(os.path.join(d, "*.wandb"))]
    if not files:
        raise FileNotFoundError(f"no offline W&B run {rid} under {workdir}/wandb")
    config, history, media = {}, [], {}
    for path in files:
        for rec in _records(path):
            kind = rec.WhichOneof("record_type")
            if kind in ("run", "config"):
                items = rec.run.config.update if kind == "run" else rec.config.update
                config.update({k: v for k, v in _nested(items).items() if k[0] != "_"})
            if kind == "history":
                row = _nested(rec.history.item)
                row = {k: v for k, v in row.items() if not k.startswith("_")}
                logged = {k: v for k, v in row.items() if isinstance(v, dict) and "_type" in v}
                for k, v in logged.items():
                    media[k] = _table(os.path.dirname(path), v)
                if not logged:
                    history.append(row)
    return {"run_id": rid, "config": config, "history": history, "media": media}


def _table(run_dir: str, ref: dict) -> list[dict] | dict:
    """A logged wandb.Table's rows (from the run's files/ copy); other media as logged."""
    if ref.get("_type") != "table-file":
        return ref
    with open(os.path.join(run_dir, "files", ref["path"])) as f:
        t = json.load(f)
    return [dict(zip(t["columns"], row, strict=True)) for row in t["data"]]
