"""The training binary's own rollout workers.

`local_fleet.py` (the provisioners behind `config.fleet`: local processes, start/stop
commands, SkyPilot) and `fleet.py` (`FleetFollower`: replaces a dead worker and follows
the controller's activation decision during RL).
"""
