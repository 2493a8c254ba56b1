"""W&B as a metrics sink, in offline mode (WANDB_MODE=offline writes the run under
<workdir>/wandb): what the offline run files hold, read back through wandb's own protobuf
records (learner_jax/reporting/wandb_sink.py read_offline_run), equals metrics.jsonl line for line;
the config is there; a reopened workdir continues the same run id; the eval table and the
plots arrive at report time."""

import json
import os

import pytest

pytest.importorskip("wandb")

from ml_collections import ConfigDict  # noqa: E402

from learner_jax.reporting import wandb_sink  # noqa: E402
from learner_jax.reporting.metrics import MetricsWriter, read_metrics  # noqa: E402


def _config(mode="offline"):
    c = ConfigDict()
    c.seed = 7
    c.loss = ConfigDict({"name": "grpo", "clip": 0.2})
    c.metrics = ConfigDict()
    c.metrics.wandb = ConfigDict({"project": "echo2-test", "entity": "", "mode": mode})
    return c


def _writer(workdir, config):
    return MetricsWriter(
        str(workdir), tensorboard=False, sinks=wandb_sink.sinks_for(config, str(workdir))
    )


def _last_per_step(rows):
    return {r["step"]: r for r in rows}


def test_offline_run_holds_metrics_jsonl_config_resume_eval_and_plots(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "elsewhere"))  # dir= wins: run in workdir
    config = _config()
    with _writer(tmp_path, config) as w:
        w.write(0, {"loss": 1.25, "phase": "sft", "policy_version": 0})
        w.write(1, {"loss": 0.5, "reward/mean": 0.125, "cost/usd": 1e-7, "phase": "rl"})
        w.write(2, {"loss": float("nan"), "reward/mean": 0.25, "fleet/active_workers": 3})
    first_id = wandb_sink.run_id(str(tmp_path))
    # Restart in the same workdir: rewound to step 2's checkpoint, steps 2 and 3 again.
    with _writer(tmp_path, config) as w:
        w.write(2, {"loss": 0.375, "reward/mean": 0.5})
        w.write(3, {"loss": 0.25, "reward/mean": 0.75, "staleness/max": 2})
        with open(tmp_path / "eval.jsonl", "w") as f:
            for row in ({"tag": "before", "step": 0, "accuracy": 0.25},
                        {"tag": "after", "step": 3, "accuracy": 0.5}):  # fmt: skip
                f.write(json.dumps(row) + "\n")
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        plt.plot([0, 1], [0, 1])
        plt.savefig(tmp_path / "reward.png")
        plt.close("all")
        w.report(str(tmp_path))
    assert wandb_sink.run_id(str(tmp_path)) == first_id
    run = wandb_sink.read_offline_run(str(tmp_path))
    assert run["run_id"] == first_id
    # Two segments of one run id (the restart resumed it, it did not start another).
    segments = [d for d in os.listdir(tmp_path / "wandb") if d.startswith("offline-run-")]
    assert len(segments) == 2 and all(first_id in d for d in segments)
    jsonl = read_metrics(str(tmp_path))
    assert len(run["history"]) == len(jsonl) == 5
    for got, want in zip(run["history"], jsonl, strict=True):
        # NaN is None in metrics.jsonl (strict JSON) and left out of W&B.
        assert got == {k: v for k, v in want.items() if v is not None}
    assert _last_per_step(run["history"])[2]["loss"] == 0.375
    assert "loss" not in run["history"][2]  # the NaN
    assert run["config"]["seed"] == 7
    assert run["config"]["loss"] == {"name": "grpo", "clip": 0.2}
    assert run["config"]["metrics"]["wandb"]["project"] == "echo2-test"
    assert run["media"]["eval/table"] == [
        {"tag": "before", "step": 0, "accuracy": 0.25},
        {"tag": "after", "step": 3, "accuracy": 0.5},
    ]
    assert run["media"]["plots/reward"]["_type"] == "image-file"
    assert not (tmp_path / "elsewhere").exists()


def test_off_without_project_and_bad_mode_refused(tmp_path):
    c = _config()
    c.metrics.wandb.project = ""
    assert wandb_sink.sinks_for(c, str(tmp_path)) == []
    assert wandb_sink.wandb_options(ConfigDict({"seed": 0})) is None
    c = _config(mode="sometimes")
    with pytest.raises(ValueError, match="metrics.wandb.mode"):
        wandb_sink.sinks_for(c, str(tmp_path))
    assert os.listdir(tmp_path) == []
