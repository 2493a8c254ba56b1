"""echo2 rollout plane: vLLM workers that generate version-tagged trajectories."""
