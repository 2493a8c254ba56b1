"""Evaluation on the rollout plane: eval leases for exactly one policy version, and what a
finished evaluation writes."""
