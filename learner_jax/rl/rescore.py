"""Sampled re-score of older versions for the behaviour log-prob audit.

    rescorer = VersionRescorer(store, learner.model_cfg, mesh, every=10, max_rows=16)
    stats = rescorer.maybe(rl_step, groups, current_version)   # -> [AuditStat]
    ctl.audit(stats)

The train step audits exactly the rows its own version sampled (bridge/control/audit.py):
the learner's log-probs are of its current parameters, so only those rows compare like
with like. A worker that tags every token with an older version would never be audited.
Every `every` RL steps this reads ONE older version that the batch's rows carry back from
the weight store (the newest S + 2 versions are kept there: every version a fresh row can
carry), converts it to Flax params on the learner's mesh, and recomputes the log-probs of
up to `max_rows` rows sampled wholly by that version (the oldest such version, seeded
choice of rows). The per-worker k3 / log-ratio sums go to the same `ctl.audit` as the
train step's.

Cost: one version read from the store plus one forward over `max_rows` rows per `every`
steps, and transiently a second copy of the params in the learner's memory (for models
near the accelerator's limit, raise `every` or set it to 0 to turn the re-score off). The
store's copy is the published one (param_dtype), the exact bytes the workers load, so an
honest bf16 worker scores the same as against its own weights.
"""

from __future__ import annotations

import logging
import time

import jax
import numpy as np

from bridge.contracts.k3 import k3
from bridge.control import audit
from bridge.model import layouts
from bridge.model.config import ModelConfig
from learner_jax import model, sharding


class VersionRescorer:
    def __init__(self, store, cfg: ModelConfig, mesh=None, rules=sharding.DEFAULT_RULES, *,
                 every: int, max_rows: int, seed: int = 0):  # fmt: skip
        if every < 0 or max_rows < 1:
            raise ValueError(f"rescore every={every} (>= 0) / max_rows={max_rows} (>= 1)")
        self.store, self.cfg, self.every, self.max_rows = store, cfg, every, max_rows
        self.targets = None if mesh is None else sharding.param_shardings(cfg, mesh, rules)
        self.rng = np.random.default_rng(seed)
        self._logprobs = jax.jit(
            lambda p, t, pos, seg, tgt: model.forward_logprobs(p, cfg, t, pos, seg, tgt)
        )
        self.last: dict = {}

    def maybe(self, rl_step: int, groups, current_version: int) -> list[audit.AuditStat]:
        """Audit stats of a re-scored older version, on every `every`-th RL step."""
        if not self.every or rl_step % self.every:
            return []
        rows = [
            (g.worker_id, t)
            for g in groups
            for t in g.trajectories
            if g.worker_id and len(set(t.versions)) == 1 and t.versions[0] < current_version
        ]
        have = set(self.store.versions())
        versions = sorted({t.versions[0] for _, t in rows} & have)
        if not versions:
            return []
        version = versions[0]  # the oldest: the longest a lie about it could last
        rows = [(w, t) for w, t in rows if t.versions[0] == version]
        pick = self.rng.choice(len(rows), size=min(self.max_rows, len(rows)), replace=False)
        t0 = time.perf_counter()
        try:
            stats = self.rescore(version, [rows[i] for i in sorted(pick)])
        except Exception as e:  # noqa: BLE001 - gc'd or corrupt meanwhile: skip, never fail the run
            logging.warning("audit re-score of version %d skipped: %s", version, e)
            return []
        self.last = {
            "audit/rescored_rows": float(len(pick)),
            "audit/rescored_version_lag": float(current_version - version),
            "audit/rescore_s": time.perf_counter() - t0,
        }
        return stats

    def params(self, version: int):
        """Flax params of a stored version (verified), laid out like the learner's."""
        rows = {r.hf_name: r for r in layouts.table(self.cfg)}
        params: dict = {}
        for name, hf in self.store.read(version, list(rows)):
            host = np.asarray(rows[name].transform.from_hf(hf), np.float32)
            if self.targets is None:
                leaf = jax.device_put(host)
            else:
                target = layouts.get_leaf(self.targets, rows[name].flax_path)
                leaf = jax.make_array_from_callback(host.shape, target, host.__getitem__)
            layouts.set_leaf(params, rows[name].flax_path, leaf)
        return params

    def rescore(self, version: int, rows) -> list[audit.AuditStat]:
        """Per-worker audit sums of `rows` [(worker_id, Trajectory)] under `version`."""
        if not rows:
            return []
        params = self.params(version)
        # Fixed shapes (max_rows x a power of two) so the jitted forward compiles once or
        # twice per run, not once per distinct row length.
        width = max(len(t.prompt_token_ids) + len(t.completion_token_ids) for _, t in rows)
        width = max(16, 1 << (width - 1).bit_length())
        n = max(self.max_rows, len(rows))
        tokens = np.zeros((n, width), np.int32)
        seg = np.zeros((n, width), np.int32)
        behaviour = np.zeros((n, width - 1), np.float32)
        mask = np.zeros((n, width - 1), np.float32)
        for i, (_, t) in enumerate(rows):
            p, c = list(t.prompt_token_ids), list(t.completion_token_ids)
            tokens[i, : len(p) + len(c)] = p + c
            seg[i, : len(p) + len(c)] = 1
            # logprobs[j] scores completion token j, predicted at position len(p) + j - 1.
            behaviour[i, len(p) - 1 : len(p) + len(c) - 1] = t.logprobs
            # Model tokens only: an episode's observation tokens (mask 0) have no behaviour
            # log-prob to audit.
            mask[i, len(p) - 1 : len(p) + len(c) - 1] = t.mask
        pos = np.broadcast_to(np.arange(width - 1, dtype=np.int32), (n, width - 1))
        learner = np.asarray(
            self._logprobs(params, tokens[:, :-1], pos, seg[:, :-1], tokens[:, 1:]), np.float32
        )
        d = np.where(mask > 0, learner - behaviour, 0.0)
        row_k3 = (k3(d.astype(np.float64)) * mask).sum(axis=1)
        k = len(rows)  # the padding rows after them have an all-zero mask
        stats = audit.row_sums_to_worker_stats(
            [w for w, _ in rows],
            np.ones(k, bool),
            row_k3[:k],
            (-d * mask).sum(axis=1)[:k],
            mask.sum(axis=1)[:k],
            version=version,
        )
        logging.debug("re-scored %d rows of version %d: %s", k, version, stats)
        return stats
