"""The exact check: every consumed token recomputed under its version and its lease's seed,
before the learner trains on it.

    checker = ExactChecker(params_fn, model_cfg, temperature=1.0, truncation=NONE)
    verdict = checker.check(groups)     # groups: ConsumedGroup from ctl.wait_batch
    verdict.refused                     # group ids that must not train
    ctl.audit(verdict.stats)            # per-worker counts -> quarantine (audit.py)

A worker samples token x at position t of sample i as argmax_v(z_v + g(seed + i, t, v))
(bridge/contracts/gumbel.py), z the processed logits of the version it served. For each
version the batch's tokens carry, the checker reads that version's published weights
(`params_fn`, the weight store's verified copy, the bytes the workers loaded; cached for
the few versions a batch spans), runs one forward over the rows holding tokens of it, and
measures each token's `gap` (learner_jax/model/logprobs.py `chunked_sampling_gap`). Tokens of an
episode's environment (mask 0) are not the model's and are not checked; a row whose tokens
span several versions (a swap mid-generation) is checked token by token, each under its
own version. A group whose lease seed the controller cannot give (-1) is refused: its
tokens cannot be verified.

Rule and numbers: bridge/contracts/exact_check.py.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from bridge.contracts import exact_check, gumbel
from bridge.control.trust import audit
from bridge.model.config import ModelConfig
from learner_jax.model import logprobs, model
from learner_jax.model import truncation as truncation_lib
from learner_jax.rl.rescore import pack_rows


@dataclasses.dataclass
class Verdict:
    refused: set[int]  # group ids with a token that is not the sampler's choice
    stats: list[audit.AuditStat]  # per worker and version: exact tokens, mismatches, flips
    metrics: dict[str, float]


class ExactChecker:
    def __init__(
        self,
        params_fn: Callable[[int], dict],
        cfg: ModelConfig,
        *,
        temperature: float,
        truncation: truncation_lib.Truncation = truncation_lib.NONE,
        margin: float = exact_check.MARGIN_ABS,
        margin_rel: float = exact_check.MARGIN_REL,
        rows_per_call: int = 32,
        chunk: int = 256,
        keep_versions: int = 4,
        options: model.ModelOptions | None = None,
    ):
        """`params_fn(version)`: Flax params of a published version (rescore.py's
        `VersionRescorer.params`). `rows_per_call` rows of a power-of-two width per
        forward (a few compiles per run); `chunk` positions per head chunk (memory
        rows_per_call x chunk x V). `keep_versions` params held between batches."""
        if not temperature > 0:
            raise ValueError(f"exact check temperature={temperature} (> 0)")
        if not (margin >= 0 and margin_rel >= 0):
            raise ValueError(f"exact check margin={margin}, margin_rel={margin_rel} (>= 0)")
        self.params_fn, self.cfg = params_fn, cfg
        self.margin = (float(margin), float(margin_rel))
        self.temperature, self.truncation = float(temperature), truncation
        self.rows_per_call, self.keep_versions = rows_per_call, keep_versions
        opts = dataclasses.replace(options or model.ModelOptions(), remat="none")
        net = model.Transformer(cfg, options=opts)
        tied = cfg.tie_word_embeddings

        def gaps(params, tokens, seg, lo, hi, temperature, truncation, greedy):
            pos = jnp.broadcast_to(
                jnp.arange(tokens.shape[1] - 1, dtype=jnp.int32), seg[:, :-1].shape
            )
            hidden = net.apply({"params": params}, tokens[:, :-1], pos, seg[:, :-1], head=False)
            weight, eqn = logprobs.head_weight(params, tied)
            return logprobs.chunked_sampling_gap(
                hidden, weight, eqn, tokens[:, 1:], lo, hi, chunk, temperature, truncation, greedy
            )

        self._gaps = jax.jit(gaps, static_argnums=(5, 6, 7))
        self._params: dict[int, dict] = {}

    @classmethod
    def for_run(cls, config, rescorer, controller_cfg) -> ExactChecker | None:
        """The training binary's checker (None with `controller.exact_check` off): the
        run's sampling, the controller's margin, and the published versions as the
        audit's re-scorer reads them (full, delta or adapter versions alike)."""
        from learner_jax import run_config  # the training binary's module, not a dependency

        if not controller_cfg.exact_check:
            return None
        return cls(
            rescorer.params,
            rescorer.cfg,
            temperature=float(config.rollout.temperature),
            truncation=truncation_lib.from_rollout(config.rollout),
            margin=controller_cfg.exact_margin,
            margin_rel=controller_cfg.exact_margin_rel,
            keep_versions=run_config.versions_kept(config),
            chunk=int(config.model.get("logprob_chunk", 0)) or 256,
            options=run_config.model_options(config),
        )

    def params(self, version: int):
        if version not in self._params:
            self._params[version] = self.params_fn(version)
            for old in sorted(self._params)[: -self.keep_versions]:
                del self._params[old]
        return self._params[version]

    def check(self, groups, temperature: float | None = None) -> Verdict:
        """The verdict on a batch's groups (ConsumedGroup, each with its `sampling_seed`);
        `temperature` (evaluation rows): sampled at it, untruncated, or 0 = greedy (the
        plain argmax, no seed needed); default the run's sampling."""
        if temperature is None:
            sampling = (self.temperature, self.truncation, False)
        elif temperature > 0:
            sampling = (float(temperature), truncation_lib.NONE, False)
        else:
            sampling = (1.0, truncation_lib.NONE, True)
        t0 = time.perf_counter()
        refused: set[int] = set()
        rows = []  # (group, trajectory)
        for g in groups:
            if g.sampling_seed < 0 and not sampling[2]:
                refused.add(g.group_id)
                continue
            rows += [(g, t) for t in g.trajectories]
        counts: dict[tuple[str, int], list[int]] = {}  # checked, mismatched, flipped
        for version in sorted({v for _, t in rows for v in t.versions}):
            of_v = [(g, t) for g, t in rows if version in t.versions]
            try:
                params = self.params(version)
            except Exception as e:  # noqa: BLE001 - gc'd or corrupt: its tokens cannot be checked
                logging.warning("exact check: version %d unreadable (%s); its groups refused",
                                version, e)  # fmt: skip
                refused.update(g.group_id for g, _ in of_v)
                continue
            for lo in range(0, len(of_v), self.rows_per_call):
                part = of_v[lo : lo + self.rows_per_call]
                gaps, scales, mask = self._row_gaps(params, version, part, sampling)
                for i, (g, _) in enumerate(part):
                    margin = exact_check.margins_for(g.engine_dtype, *self.margin)
                    bad, flips = exact_check.classify(gaps[i], scales[i], mask[i], *margin)
                    c = counts.setdefault((g.worker_id, version), [0, 0, 0])
                    c[0] += int((mask[i] > 0).sum())
                    c[1] += int(bad)
                    c[2] += int(flips)
                    if bad:
                        refused.add(g.group_id)
        stats = [
            audit.AuditStat(worker_id=w, version=v, tokens=0, sum_k3=0.0, sum_logratio=0.0,
                            exact_tokens=n, exact_mismatches=b, exact_flips=f)
            for (w, v), (n, b, f) in sorted(counts.items()) if w
        ]  # fmt: skip
        total = np.sum(list(counts.values()), axis=0) if counts else np.zeros(3)
        metrics = {
            "exact/checked_tokens": float(total[0]),
            "exact/mismatched_tokens": float(total[1]),
            "exact/flipped_tokens": float(total[2]),
            "exact/refused_groups": float(len(refused)),
            "exact/check_s": time.perf_counter() - t0,
        }
        return Verdict(refused, stats, metrics)

    def gaps_of(self, groups) -> tuple[np.ndarray, np.ndarray]:
        """Every checked token's (gap, scale), flat (bench/honest_mismatch.py)."""
        out = []
        rows = [(g, t) for g in groups for t in g.trajectories]
        sampling = (self.temperature, self.truncation, False)
        for version in sorted({v for _, t in rows for v in t.versions}):
            of_v = [(g, t) for g, t in rows if version in t.versions]
            for lo in range(0, len(of_v), self.rows_per_call):
                part = of_v[lo : lo + self.rows_per_call]
                gaps, scales, mask = self._row_gaps(self.params(version), version, part, sampling)
                out.append((gaps[mask > 0], scales[mask > 0]))
        if not out:
            return np.zeros(0), np.zeros(0)
        return np.concatenate([g for g, _ in out]), np.concatenate([s for _, s in out])

    def _row_gaps(self, params, version: int, part, sampling):
        """(gaps, scales, mask) [len(part), width - 1] of rows `part` under `sampling`
        (temperature, truncation, greedy): mask 1 on the model's tokens tagged `version`."""
        n = self.rows_per_call
        tokens, seg, mask = pack_rows([t for _, t in part], version, n)
        lo, hi = np.zeros(n, np.uint32), np.zeros(n, np.uint32)
        for i, (g, t) in enumerate(part):
            lo[i], hi[i] = gumbel.key_words(max(g.sampling_seed, 0), t.sample_index)
        gaps, scales = self._gaps(params, tokens, seg, lo, hi, *sampling)
        k = len(part)
        return np.asarray(gaps, np.float64)[:k], np.asarray(scales, np.float64)[:k], mask[:k]
