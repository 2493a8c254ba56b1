"""A submission's way in: the checks before any state change, trusted-side rewards, the
locked acceptance, and multi-turn episodes played turn by turn on the controller's state."""
