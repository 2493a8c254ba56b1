"""The fleet as the controller sees it: the worker registry, the capacity model and
cost-aware activation on measured inputs, the fleet's status and metrics line, the heartbeat
pace, and the run's end as the workers hear it. (Starting and releasing machines is
bridge/fleet.)"""
