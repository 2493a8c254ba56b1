"""The controller: leases, bounded staleness, admission, and the HTTP service around it.

`protocol.py` (pydantic wire messages), `controller.py` (the logic, one lock),
`db.py` (every SQL statement), `learner_api.py` (what the learner calls),
`validation.py` (checks before any state change), `lease_timing.py` (freshness-aware
leasing), `service.py` (FastAPI server, auth), `client.py` (what a worker calls).
"""
