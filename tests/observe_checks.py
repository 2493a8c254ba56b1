"""Checks of what users watch, shared by the demo test (tests/learner_jax/train_rl_test.py)
and the unit tests: the offline W&B run equals metrics.jsonl, and a live scrape of the
controller's /metrics agrees with `bridge.status`."""

import json
import os

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bridge.status import fetch_status
from learner_jax.reporting import wandb_sink
from learner_jax.reporting.metrics import read_metrics

# Demo flags: W&B in offline mode (the run under <workdir>/wandb).
WANDB_ARGS = ("--config.metrics.wandb.project=echo2-demo", "--config.metrics.wandb.mode=offline")


def assert_wandb_matches_metrics(workdir: str) -> dict:
    """Every metrics.jsonl line is a W&B history row with the same values (NaN/inf, None in
    the JSON, left out of W&B), across every resumed segment of the one run id."""
    run = wandb_sink.read_offline_run(workdir)
    jsonl = read_metrics(workdir)
    assert len(run["history"]) == len(jsonl), (len(run["history"]), len(jsonl))
    for got, want in zip(run["history"], jsonl, strict=True):
        assert got == {k: v for k, v in want.items() if v is not None}, (got, want)
    return run


def scrape(url: str) -> dict:
    """{(name, ((label, value), ...)): value} of one GET /metrics."""
    r = httpx.get(url.rstrip("/") + "/metrics", timeout=30)
    assert r.status_code == 200, r.text[:300]
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(r.text)
        for s in fam.samples
    }


def _expected(status: dict) -> dict:
    """The gauges a scrape must show for this `bridge.status` answer."""
    run = status["run"]
    out = {("echo2_workers", (("state", s),)): n for s, n in run["workers"].items()}
    out.update(
        {
            ("echo2_leases_in_flight", ()): status["groups/leased"],
            ("echo2_rollouts_per_second", ()): status["fleet/rollouts_per_s"],
            ("echo2_staleness_bound", ()): run["staleness_bound"],
            ("echo2_cost_usd_per_hour", ()): run["spend_usd_per_hour"],
            ("echo2_policy_version", ()): run["policy_version"],
            ("echo2_learner_step", ()): run["step"],
            ("echo2_trajectories_accepted_total", ()): status["trajectories/accepted"],
        }
    )
    return out


def assert_scrape_agrees_with_status(workdir: str, tries: int = 20) -> dict:
    """During a live run: status, scrape, status; when nothing moved between the two status
    reads (a quiet moment, retried until one comes), the scrape in between equals them;
    at most 2 x `tries` status reads, within the operator rate limit's burst (60).
    Cost so far only grows, so it is bracketed instead (it moves with the clock)."""
    with open(os.path.join(workdir, "controller.json")) as f:
        url = json.load(f)["url"]
    with open(os.path.join(workdir, "join_token")) as f:
        secret = f.read().strip()
    for _ in range(tries):
        before = fetch_status(url, secret)
        got = scrape(url)
        after = fetch_status(url, secret)
        if _expected(before) != _expected(after):
            continue
        for key, value in _expected(before).items():
            assert got[key] == value, (key, got[key], value)
        cost = got[("echo2_cost_usd_total", ())]
        assert before["run"]["spend_usd"] <= cost <= after["run"]["spend_usd"]
        return got
    raise AssertionError(f"the fleet never held still across {tries} status/scrape/status reads")
