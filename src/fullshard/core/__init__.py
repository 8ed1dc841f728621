"""fullshard's engine: sharded parameters, per-unit groups, collectives and hooks."""
