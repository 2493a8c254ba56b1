"""The controller: leases, bounded staleness, admission, and the HTTP service around it.

Top level: `protocol.py` (pydantic wire messages, shared with the workers), `config.py`
(`ControllerConfig`), `controller.py` (`Controller`: builds and wires the parts, one lock;
every operation, the workers' and the learner's), `learner_api.py` (`LearnerSide`:
staleness-aware batches, the wait for one, the checkpoint cursor), `process.py` (the
controller in a process of its own). The parts, one room per concept; a part never
references the controller, and nothing outside `http/` knows HTTP:

- `state/`: SQLite persistence (`db.py`, its leases `db_leases.py`, `group_commit.py`),
  the hot state kept in memory between flushes (`hot_state.py`), the announced version
  (`versions.py`) and the undo of a crashed run's tail (`rollback.py`).
- `leasing/`: admission and leases (`leasing.py`; the staleness rule itself is
  bridge/contracts/staleness.py), what a lease carries (`lease_content.py`,
  `sampling_seeds.py`, `prompt_stream.py`), freshness-aware timing and caps
  (`lease_timing.py`, `lease_caps.py`, `refusal_pacing.py`) and whether the run can make
  progress (`liveness.py`).
- `intake/`: a submission's way in: checks (`validation.py`), trusted-side rewards
  (`rewards.py`), the locked acceptance (`intake.py`) and multi-turn episodes played turn by
  turn (`episode_steps.py`).
- `trust/`: the log-prob audit and quarantine (`audit.py`), who registered a worker
  (`identity.py`), the join secret (`join_secret.py`), abuse limits (`limits.py`) and
  worker text made safe for logs (`log_text.py`).
- `fleet/`: the worker registry (`workers.py`), the capacity model and cost-aware
  activation (`capacity.py`, `activation.py`, `fleet_plan.py`, `capacity_advice.py`), what
  the fleet sees and reports (`fleet_status.py`, `stats_line.py`, `heartbeat_pacing.py`,
  `run_end.py`).
- `evaluation/`: eval leases for one policy version and what they write (`eval_leases.py`,
  `eval_results.py`).
- `http/`: the FastAPI service and its lean hot routes (`service.py`, `fast_routes.py`),
  the front door (`http_guard.py`, `http_bounds.py`, `body_parse.py`), Prometheus
  `/metrics` (`prometheus.py`) and the worker's typed client (`client.py`). It parses,
  authenticates, calls the controller and serializes; no decision is made there.
"""
