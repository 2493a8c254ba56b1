"""Evaluation on the rollout plane: eval leases for exactly one policy version.

    board = EvalBoard(config, task_name, content, out_path="<workdir>/eval.jsonl",
                      samples_path="<workdir>/eval_samples.jsonl")
    board.request(version=v, prompts=task.eval_prompts(), n=8, temperature=0.0, step=s)
    if eval_idle(reason, room):                    # Controller.lease: rollouts refused
        lease, more = board.offer(worker_id, worker_version, now, newest=n, live=live)
    board.check(worker_id, submission) -> (groups, prompts) # Controller.submit: the checks
    board.accept(worker_id, submission, scored)             # ... then the trusted scores
    board.take_results() -> [{"version": v, "eval/accuracy": ..., ...}]   # learner metrics
    board.take_audit_rows() -> [(worker_id, version, temperature, Trajectory)]  # the audit
    board.take_check_rows() / board.verified(accepted, refused)   # the exact check
    board.pending_versions() -> [v, ...]                    # the learner's wait at the end

The learner asks for an evaluation of version v when it publishes v and goes on training
(it never waits). The held-out prompts become eval groups (`n` samples each at the eval
temperature, 0 = greedy) that only a worker whose current version is exactly v is offered;
every token of the submission must carry version v (else 422 and the group goes back to
the queue), the whole group passes the rollout checks (validation.check_group), and the
controller's trusted scorer (rewards.py, the same hidden-token and `</think>` rules) scores
it. Eval groups live only here, never in the database's group table, so no path hands them
to the learner as training data.

Idle capacity only (`eval_idle`, Controller.lease): a worker is offered eval work only when
rollout work was refused it and no worker could be given any now: admission is full at the
newest version (the learner already has every group the staleness bound lets it use
leased or buffered), or the worker itself is refused as too slow. Rollout work always comes
first, so evaluation never takes a worker the learner's next batch needs; what it costs is
at most one eval lease's time once room opens (`max_groups_per_lease` groups).

When every group of version v is in, a summary line goes to `eval.jsonl` (tag "fleet",
`version` evaluated, `requested` versions it answers, the learner step that asked and
`accuracy`, plotted by the run report) and one line per prompt to `eval_samples.jsonl`
(eval_results.py); its eval/ metrics wait in `take_results` for the learner's next metrics
line. Leases expire after `lease_ttl_s` (groups requeue); when more than `keep_versions`
unfinished evaluations are older than a new request, the oldest are dropped unfinished.
In memory: a restarted controller asks again at the next publish.

A version no worker loads is evaluated at the newest: workers only move up, so once the
newest announced version is past v and no live worker (heard within `worker_timeout_s`)
is on v, nobody will ever generate with v. Its evaluation then moves to the newest
version (all prompts again, none of v's partial results: a summary is of one version
only), or joins that version's own queued evaluation; the summary's `requested` lists v.

Large evaluation sets finish: workers swap to the newest version between leases. The eval
lease and submit replies to a worker on v say `eval_pending` while v's eval groups are
queued, and the worker keeps v loaded (no swap) for its next request. One worker per
version is held (the first told so); the hold ends when that worker gets rollout work or
"behind" instead (room opened: it swaps), when its eval lease expires, or when it is no
longer live (a dead holder must not pin the version: another worker on v takes the hold).
Eval tokens are never trained on, so holding an old version breaks no staleness bound.

Exact check (controller.exact_check): a sampled eval group carries its lease's seed
(sampling_seeds.py) and a greedy one none; a scored group counts for its version only once
the learner has checked every token (learner_jax/evaluation/fleet_eval.py: the seeded sampler's
choice, or the argmax for greedy) and `verified` it; a refused group is evaluated again by
another lease, and its worker's count goes to the audit. A fabricated answer therefore
never reaches eval.jsonl.

Audit: eval rows carry the worker's log-probs like rollouts, so the learner audits them
the same way (learner_jax/rl/rescore.py under the version evaluated, bridge/control/trust/audit.py
sums and quarantine). Per version, a uniform sample of `audit_rows` accepted trajectories
(reservoir, seeded) waits in `take_audit_rows` once the version is finished or dropped;
a worker cannot tell which of its eval samples will be checked.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import threading
import uuid

from bridge.control.config import ControllerConfig
from bridge.control.evaluation import eval_results
from bridge.control.intake.validation import SubmissionError, check_group
from bridge.control.leasing.lease_content import LeaseContent
from bridge.control.protocol import Lease, PromptGroup, SamplingParams, Submission
from bridge.tasks import Prompt

IDLE_REASONS = ("full", "behind", "too_slow")  # rollout refusals eval work may fill
EVAL_GROUP_BASE = 1 << 50  # eval group ids: far above the database's training group ids
LEASE_PREFIX = "eval-"


def eval_idle(reason: str, room_at_newest: int) -> bool:
    """Whether a worker refused rollout work for `reason` may be given eval work: it is
    too slow for fresh rollouts, or no worker could be admitted more rollout work now
    (`room_at_newest` <= 0: leased + buffered fill what the staleness bound lets the
    learner use). Never in place of rollout work the learner will take."""
    if reason == "too_slow":
        return True
    return reason in IDLE_REASONS and room_at_newest <= 0


class EvalBoard:
    def __init__(
        self,
        config: ControllerConfig,
        task_name: str,
        content: LeaseContent,
        out_path: str | None = None,
        keep_versions: int = 2,
        samples_path: str | None = None,
        audit_rows: int = 16,
        seed: int = 0,
    ):
        self.config, self.task_name, self.content = config, task_name, content
        self.out_path, self.samples_path = out_path, samples_path
        self.keep_versions = keep_versions
        self.steps: dict[int, int] = {}  # version -> the learner step that asked
        self.scorers: dict = {}  # version -> its own RewardScorer (task.eval_file)
        self._ids = itertools.count(EVAL_GROUP_BASE)
        self._lock = threading.Lock()
        self.groups: dict[int, dict] = {}  # group id -> {version, prompt, group, state, ...}
        self.leases: dict[str, dict] = {}  # lease id -> {worker, version, groups, expires}
        self.pending: dict[int, int] = {}  # version -> groups not yet scored
        self.results: list[dict] = []  # finished versions' summaries, for the learner
        self.reservoir = eval_results.Reservoir(audit_rows, seed)  # for the audit
        self.temperatures: dict[int, float] = {}  # version -> its eval temperature
        self.requested: dict[int, list[int]] = {}  # version -> the requests it answers
        self.audit_ready: list[tuple] = []  # (worker, version, temperature, Trajectory)
        self.holders: dict[int, str] = {}  # version -> the one worker kept on it

    # -- the learner (through Controller.evaluation: the controller may be another process) --
    def configure(self, workdir: str) -> None:
        """Write summaries to <workdir>/eval.jsonl and per-prompt lines beside them."""
        self.out_path = os.path.join(workdir, "eval.jsonl")
        self.samples_path = os.path.join(workdir, "eval_samples.jsonl")

    def file_scorer(self, path: str):
        """A trusted scorer of a benchmark file's task (bridge/tasks/eval_file.py)."""
        from bridge.control.intake.rewards import RewardScorer
        from bridge.tasks import make_task

        task = make_task("eval_file", path=path)
        return RewardScorer(task, self.content.codec, self.config.reward_timeout_s)

    def request(
        self, version: int, prompts: list[Prompt], n: int, temperature: float, step=None,
        scorer=None, eval_file: str = "",
    ) -> int:  # fmt: skip
        """Queue an evaluation of `version` (published at learner `step`, default the
        version); returns the number of eval groups. `scorer`: a `RewardScorer` of the
        prompts' own task, or `eval_file` (a `task.eval_file` path) to build one here;
        default the controller's."""
        if eval_file and scorer is None:
            scorer = self.file_scorer(eval_file)
        if temperature == 0.0:  # greedy: every sample is the same, and vLLM refuses n > 1
            n = 1
        sampling = SamplingParams(
            temperature=temperature, max_tokens=self.config.sampling.max_tokens,
            stop_token_ids=list(self.config.sampling.stop_token_ids),
        )  # fmt: skip
        with self._lock:
            if version in self.pending:
                return 0
            for p in prompts:
                gid = next(self._ids)
                # The worker gets an id that says nothing (`eval/<group id>`): a held-out
                # prompt's own id is a digest of a public seed, and for a task that hides
                # state (a poker deal) the worker could look the deal up from it. Results
                # keep the real id (`row["prompt"]`).
                group = PromptGroup(
                    group_id=gid, prompt_id=f"eval/{gid}", task=self.task_name, prompt=p.text,
                    prompt_token_ids=self.content.prompt_ids(p.text), n=n, sampling=sampling,
                )  # fmt: skip
                self.groups[gid] = dict(version=version, prompt=p, group=group, state="queued")
            self.pending[version] = len(prompts)
            self.steps[version] = version if step is None else int(step)
            self.temperatures[version] = float(temperature)
            self.requested[version] = [version]
            if scorer is not None:
                self.scorers[version] = scorer
            for old in sorted(self.pending)[: -(self.keep_versions + 1)]:
                self._drop(old)
            return len(prompts)

    def take_results(self) -> list[dict]:
        with self._lock:
            out, self.results = self.results, []
            return out

    def pending_versions(self) -> list[int]:
        """Versions whose evaluation is queued or running (moved ones: their new version)."""
        with self._lock:
            return sorted(self.pending)

    def take_audit_rows(self) -> list[tuple]:
        """The sampled eval trajectories of finished (or dropped) versions, once each:
        [(worker_id, version, temperature, Trajectory)]."""
        with self._lock:
            out, self.audit_ready = self.audit_ready, []
            return out

    # -- workers -----------------------------------------------------------------------------
    def offer(
        self, worker_id: str, worker_version: int, now: float, max_groups: int = 1,
        newest: int | None = None, live: dict[str, int] | None = None,
    ):  # fmt: skip
        """(an eval lease of version `worker_version` exactly, or None (no such work);
        whether more of that version's eval groups stay queued: `eval_pending`). `newest`:
        the announced version; `live`: worker id -> version of the live workers (the
        others' holds end; versions none of them is on, older than `newest`, move there)."""
        with self._lock:
            self._expire(now)
            if live is not None:
                self._forget_dead(live)
                if newest is not None:
                    self._follow(newest, live)
            rows = [
                g for g in self.groups.values()
                if g["state"] == "queued" and g["version"] == worker_version
            ][: max(1, min(max_groups, self.config.max_groups_per_lease))]  # fmt: skip
            if not rows:
                return None, False
            lease_id = LEASE_PREFIX + uuid.uuid4().hex
            expires = now + self.config.lease_ttl_s
            for g in rows:
                g.update(state="leased", seed=self._seed(lease_id, g["group"]))
            ids = [g["group"].group_id for g in rows]
            self.leases[lease_id] = dict(
                worker=worker_id, version=worker_version, groups=ids, expires=expires
            )
            groups = [_seeded(g["group"], g["seed"]) for g in rows]
            lease = Lease(lease_id=lease_id, expires_at=expires, groups=groups)
            return lease, self._hold(worker_id, worker_version)

    def _seed(self, lease_id: str, group: PromptGroup) -> int:
        """The lease's sampling seed of a sampled eval group; -1 for greedy (no noise)."""
        if group.sampling.temperature == 0.0 or self.content.seeds is None:
            return -1
        return self.content.seeds.seed(lease_id, group.group_id)

    def unhold(self, worker_id: str) -> None:
        """`worker_id` got rollout work (or "behind"): it swaps, so it holds nothing."""
        with self._lock:
            for v in [v for v, w in self.holders.items() if w == worker_id]:
                del self.holders[v]

    def idle(self) -> bool:
        """Nothing queued to evaluate and nobody held: `offer` needs no view of the live
        fleet (building it is O(fleet) per refused lease: 11% of a 2000-worker controller)."""
        with self._lock:
            return not (self.pending or self.holders)

    def owns(self, lease_id: str) -> bool:
        return lease_id.startswith(LEASE_PREFIX)

    def _hold(self, worker_id: str, version: int | None) -> bool:
        """The `eval_pending` reply: eval groups of `version` wait, and `worker_id` is the
        one worker held on it (or becomes it)."""
        queued = version is not None and any(
            g["state"] == "queued" and g["version"] == version for g in self.groups.values()
        )
        holder = self.holders.setdefault(version, worker_id) if queued else None
        if not queued:
            self.holders.pop(version, None)
        return holder == worker_id

    def check(self, worker_id: str, sub: Submission, newest: int):
        """(groups to score, group id -> Prompt); SubmissionError (422/404/409) else. A token
        at another version than the lease's requeues the group and refuses the submission."""
        with self._lock:
            lease = self.leases.get(sub.lease_id)
            if lease is None or lease["worker"] != worker_id:
                raise SubmissionError(f"no active eval lease {sub.lease_id} of yours", 404)
            version, fresh, prompts = lease["version"], [], {}
            for result in sub.groups:
                if result.group_id not in lease["groups"]:
                    raise SubmissionError(f"group {result.group_id} is not in this eval lease")
                row = self.groups.get(result.group_id)
                if row is None or row["state"] != "leased":
                    continue  # dropped or already in: a resubmission is a no-op
                for t in result.trajectories:
                    if any(v != version for v in t.versions):
                        self._requeue(sub.lease_id)
                        raise SubmissionError(
                            f"group {result.group_id}: eval lease of version {version}, a "
                            f"token tagged {sorted(set(t.versions) - {version})[0]}; "
                            "evaluation results count only at the version evaluated"
                        )
                g = row["group"]
                check_group(
                    result, prompt_id=g.prompt_id, n=g.n, sampling=g.sampling,
                    vocab_size=self.config.vocab_size,
                    max_prompt_tokens=self.config.max_prompt_tokens, newest_version=newest,
                    prompt_token_ids=g.prompt_token_ids, lease_version=version,
                    # a MoE policy's routing, checked but never required: nothing replays it
                    routing=dataclasses.replace(self.config.routing, required=False),
                )  # fmt: skip
                fresh.append(result)
                prompts[result.group_id] = row["prompt"]
            return fresh, prompts

    def accept(self, worker_id: str, sub: Submission, scored) -> int:
        """Record (group id, trajectories, errors) scored by the trusted scorer; returns
        the number of groups taken. Ends the lease."""
        with self._lock:
            lease = self.leases.pop(sub.lease_id, None)
            taken = 0
            for gid, trajs, _errors in scored:
                row = self.groups.get(gid)
                if row is None or row["state"] != "leased":
                    continue
                row.update(trajectories=trajs, worker=worker_id)
                taken += 1
                if self.config.exact_check:  # counted once the learner checked every token
                    row["state"] = "checking"
                else:
                    self._done(row)
            if lease is not None:  # groups of the lease not submitted go back to the queue
                for gid in lease["groups"]:
                    if gid in self.groups and self.groups[gid]["state"] == "leased":
                        self.groups[gid]["state"] = "queued"
            return taken

    def _done(self, row: dict) -> None:
        """A scored (and, with the exact check, verified) group counts for its version."""
        row["state"] = "done"
        for t in row["trajectories"]:
            self.reservoir.add(row["version"], row["worker"], t)
        eval_results.write(self.samples_path, [eval_results.prompt_line(row)])
        self.pending[row["version"]] -= 1
        if self.pending[row["version"]] == 0:
            self._finish(row["version"])

    # -- the exact check (learner_jax/evaluation/fleet_eval.py) ----------------------------------
    def take_check_rows(self) -> list[dict]:
        """Scored groups waiting for the learner's exact check: {group_id, version,
        temperature, seed, worker, trajectories}. Until `verified` answers they stay here
        (a poll that failed takes them again)."""
        with self._lock:
            return [
                dict(group_id=gid, version=g["version"], seed=g["seed"], worker=g["worker"],
                     temperature=g["group"].sampling.temperature, trajectories=g["trajectories"])
                for gid, g in self.groups.items() if g["state"] == "checking"
            ]  # fmt: skip

    def verified(self, accepted: list[int], refused: list[int]) -> None:
        """The learner's verdict: accepted groups count, refused ones (a token that is not
        the sampler's choice) are evaluated again by another lease."""
        with self._lock:
            for gid in accepted:
                row = self.groups.get(gid)
                if row is not None and row["state"] == "checking":
                    self._done(row)
            for gid in refused:
                row = self.groups.get(gid)
                if row is not None and row["state"] == "checking":
                    row.update(state="queued", trajectories=None, worker=None)

    def submit(self, worker_id: str, sub: Submission, newest: int, scorer) -> dict:
        """check -> trusted scores (outside the board's lock) -> accept: the SubmitResponse
        fields accepted (group ids), duplicates and eval_pending (more of the lease's
        version queued). The caller holds no lock while the rewards run."""
        fresh, prompts = self.check(worker_id, sub, newest)
        with self._lock:
            lease = self.leases.get(sub.lease_id)
            version = lease["version"] if lease else None
            scorer = self.scorers.get(version, scorer) if lease else scorer
            # What the episodes played through POST /v1/episode drew (rewards.py).
            played = dict(lease.get("episodes", {})) if lease else {}
        drawn = {g.group_id: {k[1]: s[3] for k, s in played.items() if k[0] == g.group_id}
                 for g in fresh}  # fmt: skip
        scored = [(g.group_id, *scorer.score_group(g.group_id, prompts[g.group_id], g.trajectories,
                                                   drawn[g.group_id]))
                  for g in fresh]  # fmt: skip
        self.accept(worker_id, sub, scored)
        accepted = [gid for gid, _, _ in scored]
        with self._lock:
            more = self._hold(worker_id, version)
        dups = [g.group_id for g in sub.groups if g.group_id not in accepted]
        return dict(accepted=accepted, duplicates=dups, eval_pending=more)

    def release(self, worker_id: str, lease_id: str) -> bool:
        with self._lock:
            lease = self.leases.get(lease_id)
            if lease is None or lease["worker"] != worker_id:
                return False
            self._requeue(lease_id)
            return True

    # -- inside the lock -------------------------------------------------------------------
    def _expire(self, now: float) -> None:
        for lease_id in [k for k, v in self.leases.items() if v["expires"] <= now]:
            lease = self.leases[lease_id]
            if self.holders.get(lease["version"]) == lease["worker"]:
                del self.holders[lease["version"]]  # its holder lost it: maybe dead
            self._requeue(lease_id)

    def _forget_dead(self, live: dict[str, int]) -> None:
        """A holder no longer live (or no longer on its version) holds nothing."""
        for v, w in list(self.holders.items()):
            if live.get(w) != v:
                del self.holders[v]

    def _follow(self, newest: int, live: dict[str, int]) -> None:
        """Move the evaluation of each version older than `newest` that no live worker is
        on to `newest`: nobody will load it again (workers only move up)."""
        on = set(live.values())
        for v in sorted(self.pending):
            if v < newest and v not in on:
                self._move(v, newest)

    def _move(self, version: int, to: int) -> None:
        asked = self.requested.get(version, [version])
        logging.info(  # routine when rollouts keep the fleet busy: eval.jsonl says it
            "fleet eval of version %d: no live worker holds it any more; evaluating version "
            "%d instead (eval.jsonl: version %d, requested %s)", version, to, to, asked,
        )  # fmt: skip
        if to not in self.pending:  # all prompts again, at `to`
            rows = [g for g in self.groups.values() if g["version"] == version]
            for row in rows:
                gid = next(self._ids)
                group = row["group"].model_copy(update={"group_id": gid})
                self.groups[gid] = dict(version=to, prompt=row["prompt"], group=group,
                                        state="queued")  # fmt: skip
            self.pending[to], self.requested[to] = len(rows), []
            self.steps[to] = self.steps.get(version, version)
            self.temperatures[to] = self.temperatures.get(version, 1.0)
            if version in self.scorers:
                self.scorers[to] = self.scorers[version]
        self.requested[to] = sorted(set(self.requested[to]) | set(asked))
        self._drop(version)

    def _requeue(self, lease_id: str) -> None:
        lease = self.leases.pop(lease_id, None)
        for gid in lease["groups"] if lease else ():
            if gid in self.groups and self.groups[gid]["state"] == "leased":
                self.groups[gid]["state"] = "queued"

    def _drop(self, version: int) -> None:
        for gid in [k for k, g in self.groups.items() if g["version"] == version]:
            del self.groups[gid]
        for d in (self.pending, self.steps, self.scorers, self.holders, self.requested):
            d.pop(version, None)
        temperature = self.temperatures.pop(version, 1.0)
        for worker, traj in self.reservoir.pop(version):  # finished or not: audit them
            self.audit_ready.append((worker, version, temperature, traj))

    def _finish(self, version: int) -> None:
        rows = [g for g in self.groups.values() if g["version"] == version]
        step = self.steps.get(version, version)
        summary = eval_results.summary(version, rows, step, self.requested.get(version, []))
        eval_results.write(self.out_path, [summary])
        self.results.append(summary)
        self._drop(version)


def _seeded(group: PromptGroup, seed: int) -> PromptGroup:
    if seed < 0:
        return group
    return group.model_copy(update={"sampling": group.sampling.model_copy(update={"seed": seed})})
