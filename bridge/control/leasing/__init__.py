"""Leasing: admission under the staleness bound, what a lease carries (prompt ids, sampling
seeds, the prompt stream), freshness-aware timing and caps, and whether the run can make
progress."""
