"""Where the audit's re-score spends its rows (issue 23 item 6): on the workers it knows
least about.

    focus = AuditFocus.for_controller(ctl.config)     # audit_min_tokens, audit_sampling_z
    focus.note(stats)                                 # every AuditStat sent to ctl.audit
    focus.urgent("w-1")                               # True: re-score its rows every step

The train step audits the rows the learner's own version sampled; the rest (rows 1..S
versions old) are seen only by the sampled re-score (rescore.py), `audit_rescore_rows`
rows per version every `audit_rescore_every` steps, drawn from the whole batch. A worker
whose rows are mostly old (a slow one, or one that picks tokens itself and so returns
late) then needs minutes before `audit_min_tokens` of its tokens are judged: the greedy
picker of the hostile soak got 65 groups accepted in ~6 minutes before its verdict.

So the re-score also scores, EVERY step, the rows of workers that are not yet settled:
fewer than `min_tokens` audited tokens (new: no verdict possible yet), or a sampling Z
past `suspect_z` (half the quarantine threshold: drifting towards it). Once a worker has a
record and a quiet Z its rows go back to the shared sample, so the extra cost is about
`min_tokens` tokens per worker per learner run. Which rows are picked depends only on who
sent them, never on their tokens, so each added term still has mean 0 for an honest
sampler and Z stays ~N(0, 1) (the false-positive rate does not move; the sample size does).

The learner keeps this tally itself (the controller's `audit` table is the verdict's
record): a restarted learner starts with every worker unsettled, which costs one more
`min_tokens` of re-scoring per worker and judges nothing twice (the controller adds up).
The sums decay as the controller's do (audit.py: deviations by w, variances by w^2), so the
Z here is the one the controller judges by.
"""

from __future__ import annotations

import math

from bridge.contracts import sampling_check


class AuditFocus:
    def __init__(self, min_tokens: int, suspect_z: float, window_tokens: int):
        if min_tokens < 0 or suspect_z < 0 or window_tokens <= 0:
            raise ValueError(
                f"audit focus: min_tokens={min_tokens} (>= 0), suspect_z={suspect_z} (>= 0, "
                f"0 = Z ignored), window_tokens={window_tokens} (> 0)"
            )
        self.min_tokens, self.suspect_z, self.window = min_tokens, suspect_z, window_tokens
        self._sums: dict[str, list[float]] = {}  # worker -> [tokens in all, dev, var]

    @classmethod
    def for_controller(cls, c) -> AuditFocus:
        """From the controller's config (bridge/control/config.py): its verdict thresholds."""
        return cls(c.audit_min_tokens, c.audit_sampling_z / 2.0, c.audit_window_tokens)

    def note(self, stats) -> None:
        """Fold in `AuditStat`s as the controller does (`WorkerAudit.add`)."""
        for st in stats:
            if st.tokens <= 0 or not (math.isfinite(st.sum_dev) and math.isfinite(st.sum_var)):
                continue
            s = self._sums.setdefault(st.worker_id, [0.0, 0.0, 0.0])
            keep = math.exp(-st.tokens / self.window)
            s[0] += st.tokens
            s[1] = keep * s[1] + st.sum_dev
            s[2] = keep * keep * s[2] + st.sum_var
        return None

    def z(self, worker_id: str) -> float:
        s = self._sums.get(worker_id)
        return 0.0 if s is None else sampling_check.z_score(s[1], s[2])

    def urgent(self, worker_id: str) -> bool:
        """Whether `worker_id`'s rows are re-scored every step: too few audited tokens for a
        verdict, or a Z on its way to one."""
        s = self._sums.get(worker_id)
        if s is None or s[0] < self.min_tokens:
            return True
        return self.suspect_z > 0 and abs(self.z(worker_id)) > self.suspect_z
