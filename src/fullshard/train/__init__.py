"""Models and (soon) the trainer built on fullshard."""
