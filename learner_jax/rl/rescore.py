"""Sampled re-score of older versions for the behaviour log-prob audit.

    rescorer = VersionRescorer(store, learner.model_cfg, mesh, every=10, max_rows=16)
    stats = rescorer.maybe(rl_step, groups, current_version)   # -> [AuditStat]
    ctl.audit(stats)

The train step audits exactly the rows its own version sampled (bridge/control/trust/audit.py):
the learner's log-probs are of its current parameters, so only those rows compare like
with like. A worker that tags every token with an older version would never be audited.
Every `every` RL steps this reads back from the weight store EVERY version the batch's
other rows carry (the newest S + 2 versions are kept there: every version a fresh row can
carry; issue 23 item 5: a lie about any but the oldest tag escaped when only the oldest was
read), converts each to Flax params on the learner's mesh, and recomputes the log-probs of
up to `max_rows` rows holding tokens of that version (seeded choice of rows), scoring only
the tokens tagged with it: a mixed row (a swap mid-generation; the train step skips it) is
audited token by token, each under the version it claims. The per-worker k3 / log-ratio
sums go to the same `ctl.audit` as the train step's.

Focus (`focus`, audit_focus.py; `controller.audit_focus`): besides that shared sample, the
rows of workers the audit cannot judge yet (fewer than `audit_min_tokens` audited tokens,
or a sampling Z drifting towards the threshold) are re-scored on EVERY step, up to
`max_rows` per worker and version, so a new worker whose rows are mostly old is judged
within a few of its groups instead of minutes (the hostile soak's greedy picker:
BUILD_NOTES.md).

Cost: up to S + 1 version reads from the store plus one forward over `max_rows` rows each,
per `every` steps (and per step while some unsettled worker sent old rows: bounded by
`audit_min_tokens` tokens per worker), and transiently a second copy of the params in the
learner's memory (for models
near the accelerator's limit, raise `every` or set it to 0 to turn the re-score off). The
store's copy is the published one (bridge.publish_dtype), the bytes the workers load, so an
honest bf16 worker scores the same as against its own weights.

Evaluation rows (`eval.on=fleet`, bridge/control/evaluation/eval_leases.py) are audited the
same way: `rescore_eval(rows)` re-scores the controller's sample of each evaluated version's
trajectories under that version, at the eval temperature without truncation (greedy
evaluation: vLLM reports the untempered log-softmax, i.e. temperature 1).
"""

from __future__ import annotations

import dataclasses
import logging
import time

import jax
import numpy as np

from bridge.contracts import sampling_check
from bridge.control.trust import audit
from bridge.model import layouts
from bridge.model.config import ModelConfig
from learner_jax.model import model, sharding
from learner_jax.model import truncation as truncation_lib
from learner_jax.rl.audit_focus import AuditFocus


class VersionRescorer:
    def __init__(self, store, cfg: ModelConfig, mesh=None, rules=sharding.DEFAULT_RULES, *,
                 every: int, max_rows: int, seed: int = 0, temperature: float = 1.0,
                 truncation: truncation_lib.Truncation = truncation_lib.NONE,
                 params_fn=None, focus: AuditFocus | None = None,
                 options: model.ModelOptions | None = None):  # fmt: skip
        """`params_fn(version)`: the params of a stored version, instead of reading full
        weights (a LoRA run's store holds adapter versions: WeightPublisher.policy_reader).
        `focus`: re-score unsettled workers' rows every step (audit_focus.py); None = the
        shared sample alone. `options`: the learner's attention and log-prob chunking
        (`model.logprob_chunk`: without it a re-score of 16 rows of 1k tokens at vocabulary
        151k would hold ~10 GB of logits)."""
        if every < 0 or max_rows < 1:
            raise ValueError(f"rescore every={every} (>= 0) / max_rows={max_rows} (>= 1)")
        if not temperature > 0:
            raise ValueError(f"rescore temperature={temperature} (> 0)")
        self.store, self.cfg, self.every, self.max_rows = store, cfg, every, max_rows
        self.targets = None if mesh is None else sharding.param_shardings(cfg, mesh, rules)
        self.rng = np.random.default_rng(seed)
        options = dataclasses.replace(options or model.ModelOptions(), remat="none")
        net = model.Transformer(cfg, options=options)
        # The distribution the workers sampled from (the run's temperature and truncation,
        # as the train step scores; evaluation rows: the eval temperature): log p(token),
        # and H and Var[log p] per position for the sampling check
        # (bridge/contracts/sampling_check.py).
        self.sampling = (float(temperature), truncation)
        self._stats = jax.jit(
            lambda p, t, pos, seg, tgt, temp, trunc: model.token_stats(
                net, p, t, pos, seg, tgt, temp, trunc, variance=True
            ),
            static_argnums=(5, 6),
        )
        self.last: dict = {}
        self.focus = focus
        if params_fn is not None:
            self.params = params_fn

    @classmethod
    def for_run(cls, config, learner, publisher, leader, audit_cfg) -> VersionRescorer:
        """The training binary's re-scorer: the controller's audit settings (`audit_cfg`,
        its ControllerConfig: the thresholds the focus follows), the run's sampling, and for
        LoRA the stored adapter versions. Process 0 alone runs it, so with
        several processes (`leader` set) it stays on its own devices: a computation on the
        global mesh would wait for the others forever."""
        from learner_jax import run_config  # the training binary's module, not a dependency

        c = config.controller
        return cls(
            publisher.versions_store,
            learner.model_cfg,
            None if leader is not None else learner.mesh,
            learner.rules,
            every=c.audit_rescore_every,
            max_rows=c.audit_rescore_rows,
            seed=config.seed,
            temperature=float(config.rollout.temperature),
            truncation=truncation_lib.from_rollout(config.rollout),
            params_fn=publisher.policy_reader(),
            focus=AuditFocus.for_controller(audit_cfg) if c.audit_focus else None,
            options=run_config.model_options(config),
        )

    def note(self, stats) -> None:
        """Tell the focus about audit stats made elsewhere (the train step's rows)."""
        if self.focus is not None:
            self.focus.note(stats)

    def maybe(self, rl_step: int, groups, current_version: int) -> list[audit.AuditStat]:
        """Audit stats of a re-score of every version the batch's tokens carry (the train
        step audits the rows wholly of `current_version`): a sample of all rows on every
        `every`-th RL step, and the rows of unsettled workers (the focus) on every step."""
        if not self.every:
            return []
        scheduled = rl_step % self.every == 0
        urgent = self.focus.urgent if self.focus is not None else (lambda w: False)
        rows = [
            (g.worker_id, t)
            for g in groups
            for t in g.trajectories
            if g.worker_id and set(t.versions) != {current_version}
            and (scheduled or urgent(g.worker_id))
        ]  # fmt: skip
        have = set(self.store.versions())
        # Every tag, not only the oldest: a lie about any version but the oldest would
        # otherwise never be looked at. Mixed rows (a swap mid-generation) are scored per
        # token, each under the version it claims.
        versions = sorted({v for _, t in rows for v in t.versions} & have)
        t0, stats, picked, focused = time.perf_counter(), [], 0, 0
        for version in versions:
            of_v = [(w, t) for w, t in rows if version in t.versions]
            # Up to max_rows of each unsettled worker's rows (a cheater cannot hide among
            # new ids), on top of the shared sample of the others', not instead of it (a
            # stream of new ids cannot crowd the settled workers' rows out).
            first = [r for w in sorted({w for w, _ in of_v if urgent(w)})
                     for r in self._sample([x for x in of_v if x[0] == w])]  # fmt: skip
            rest = [r for r in of_v if not urgent(r[0])]
            chosen = first + (self._sample(rest) if scheduled else [])
            try:
                stats += self.rescore(version, chosen)
            except Exception as e:  # noqa: BLE001 - gc'd or corrupt meanwhile: skip, never fail the run
                logging.warning("audit re-score of version %d skipped: %s", version, e)
                continue
            picked += len(chosen)
            focused += len(first)
        if not picked:
            return []
        self.last = {
            "audit/rescored_rows": float(picked),
            "audit/rescored_focus_rows": float(focused),
            "audit/rescored_versions": float(len(versions)),
            "audit/rescored_version_lag": float(current_version - versions[0]),
            "audit/rescore_s": time.perf_counter() - t0,
        }
        return stats

    def _sample(self, rows):
        """Up to `max_rows` of `rows`, seeded choice, in their order."""
        pick = self.rng.choice(len(rows), size=min(self.max_rows, len(rows)), replace=False)
        return [rows[i] for i in sorted(pick)]

    def rescore_eval(self, rows) -> list[audit.AuditStat]:
        """Audit stats of eval rows [(worker_id, version, temperature, Trajectory)] (the
        controller's `take_audit_rows`), each under its version at its eval temperature
        (untruncated; greedy -> 1); a version no longer stored is skipped with a warning."""
        by: dict = {}
        for worker, version, temperature, t in rows:
            # greedy: vLLM's T=1 log-probs, and no sampling check (argmax tokens are not
            # samples: the exact check judges them)
            temp = float(temperature) if temperature > 0 else 1.0
            by.setdefault((int(version), temp, temperature > 0), []).append((worker, t))
        stats = []
        for (version, temp, sampled), of_v in sorted(by.items()):
            for lo in range(0, len(of_v), self.max_rows):
                try:
                    chunk = of_v[lo : lo + self.max_rows]
                    stats += self.rescore(version, chunk, (temp, truncation_lib.NONE), sampled)
                except Exception as e:  # noqa: BLE001 - gc'd or corrupt meanwhile: skip
                    logging.warning("audit of eval rows of version %d skipped: %s", version, e)
                    break
        return stats

    def params(self, version: int):
        """Flax params of a stored version (verified), laid out like the learner's."""
        table = layouts.table(self.cfg)
        groups = layouts.leaves(table)
        leaf_of = {r.hf_name: r.flax_path for r in table}
        pending: dict = {}  # a stacked expert leaf's tensors until all E have been read
        params: dict = {}
        for name, hf in self.store.read(version, [r.hf_name for r in table]):
            path = leaf_of[name]
            pending.setdefault(path, {})[name] = hf
            rows = groups[path]
            if len(pending[path]) < len(rows):
                continue
            tensors = pending.pop(path)
            host = np.asarray(layouts.leaf_from_hf(rows, tensors.__getitem__), np.float32)
            if self.targets is None:
                leaf = jax.device_put(host)
            else:
                target = layouts.get_leaf(self.targets, path)
                leaf = jax.make_array_from_callback(host.shape, target, host.__getitem__)
            layouts.set_leaf(params, path, leaf)
        return params

    def rescore(self, version: int, rows, sampling=None, sampled=True) -> list[audit.AuditStat]:
        """Per-worker audit sums of `rows` [(worker_id, Trajectory)] under `version`, at
        `sampling` = (temperature, truncation) (default the run's); `sampled` False (greedy
        rows): the log-prob audit only, not the sampling check."""
        if not rows:
            return []
        params = self.params(version)
        stats = []
        for lo in range(0, len(rows), self.max_rows):
            stats += self._score(params, version, rows[lo : lo + self.max_rows], sampling, sampled)
        self.note(stats)
        return stats

    def _score(self, params, version: int, rows, sampling, sampled=True) -> list[audit.AuditStat]:
        """`rescore` of at most `max_rows` rows under `params`."""
        tokens, seg, mask = pack_rows([t for _, t in rows], version, self.max_rows)
        n, width = tokens.shape
        behaviour = np.zeros((n, width - 1), np.float32)
        for i, (_, t) in enumerate(rows):
            p = len(t.prompt_token_ids)
            behaviour[i, p - 1 : p + len(t.completion_token_ids) - 1] = t.logprobs
        pos = np.broadcast_to(np.arange(width - 1, dtype=np.int32), (n, width - 1))
        temp, trunc = sampling or self.sampling
        learner, entropy, _, variance, collision = (
            np.asarray(x, np.float64)
            for x in self._stats(
                params, tokens[:, :-1], pos, seg[:, :-1], tokens[:, 1:], temp, trunc
            )
        )
        mask = mask.astype(np.float64)
        k = len(rows)  # the padding rows after them have an all-zero mask
        row_k3, row_lr, row_n = (
            x[:k] for x in audit.row_sums(learner, behaviour.astype(np.float64), mask)
        )
        row_dev, row_var, _ = (
            x[:k] for x in sampling_check.row_sums(learner, entropy, variance, mask)
        )
        row_evid = sampling_check.row_evidence(learner, collision, mask)[:k]
        if not sampled:
            row_dev = row_var = row_evid = None
        ones = np.ones(k, bool)
        stats = audit.row_sums_to_worker_stats(
            [w for w, _ in rows], ones, row_k3, row_lr, row_n, version, row_dev, row_var,
            row_evid,
        )  # fmt: skip
        logging.debug("re-scored %d rows of version %d: %s", k, version, stats)
        return stats


def pack_rows(trajectories, version: int, rows: int):
    """(tokens, segment ids [rows, W], mask [rows, W - 1]) of trajectories laid out as the
    learner scores them: prompt + completion from position 0, W a power of two >= 16 (so a
    jitted forward compiles once or twice per run, not once per row length), and the mask
    1 on the completion tokens the model sampled (an episode's observation tokens are not)
    that are tagged `version`; completion token j is the target of position len(p) + j - 1.
    Rows past the trajectories are padding (all zero)."""
    width = max(len(t.prompt_token_ids) + len(t.completion_token_ids) for t in trajectories)
    width = max(16, 1 << (width - 1).bit_length())
    tokens = np.zeros((rows, width), np.int32)
    seg = np.zeros((rows, width), np.int32)
    mask = np.zeros((rows, width - 1), np.float32)
    for i, t in enumerate(trajectories):
        p, c = list(t.prompt_token_ids), list(t.completion_token_ids)
        tokens[i, : len(p) + len(c)] = p + c
        seg[i, : len(p) + len(c)] = 1
        of_version = np.asarray(t.versions) == version
        mask[i, len(p) - 1 : len(p) + len(c) - 1] = np.asarray(t.mask) * of_version
    return tokens, seg, mask
