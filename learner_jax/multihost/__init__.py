"""The learner as several processes.

`distributed.py` (JAX's distributed runtime from the config's `distributed` section; who
leads, barriers) and `mirror.py` (during RL process 0 drives and the others replay its
collectives in the same order).
"""
