"""Trust and audit: workers are other people's machines. The behaviour log-prob audit and
quarantine, registration identities, the join secret, abuse limits, and worker-supplied
text made safe for a log line."""
