"""The learning plane: the Flax policy model, its sharding, checkpoint import and training."""
