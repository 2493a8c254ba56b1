"""Fleet planner: simulate an ECHO-2 run (learner, rollout fleet, weight broadcast) before
renting it. `python -m bridge.plan --fleet=FLEET.json --out=PLAN.json`; see __main__.py."""
