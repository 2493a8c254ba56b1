"""Peer-assisted pipelined weight broadcast: chunk plans (chunks.py), relay topology
(topology.py) and the controller-side bookkeeping (state.py). The relay itself runs in
every rollout worker (rollout_gpu/relay.py)."""
