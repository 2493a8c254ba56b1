"""echo2 bridge: everything the JAX learner and the PyTorch rollout workers share.

Imports neither jax nor torch at module level (numpy, tensorstore, pydantic only).
"""
