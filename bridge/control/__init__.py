"""The controller: leases, bounded staleness, admission, and the HTTP service around it.

`protocol.py` (pydantic wire messages), `controller.py` (wires the parts, one lock),
`db.py` (`ControllerDB`: every SQL statement, all durable state), `versions.py` (the
announced version), `workers.py` (registration, tokens, billing), `leasing.py` (admission
and leases; the staleness rule itself is bridge/contracts/staleness.py), `learner_api.py`
(`LearnerSide`: what the learner calls), `prompt_stream.py` (resumable training
prompts), `validation.py` (checks before any state change), `intake.py` (a submission:
check, score outside the lock, accept), `rewards.py` (trusted-side rewards), `audit.py`
(behaviour log-prob audit, quarantine, both kept in the database), `lease_timing.py`
(freshness-aware leasing), `capacity.py` (the capacity model), `activation.py`
(cost-aware activation), `service.py` (FastAPI server, auth), `client.py` (what a worker
calls).
"""
