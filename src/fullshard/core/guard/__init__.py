"""The guard that ranks agree: each rank's ledger of what it ran, the comparison of
ledgers on the control channel, and the check-ins of collective calls outside a step
(Note [ranks agree on every collective] in divergence.py)."""
