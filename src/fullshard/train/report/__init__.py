"""What a person sees of a run, from rank 0: ``metrics.py`` (``metrics.jsonl`` and the
memory figures), ``progress.py`` (the progress line), ``plot.py`` (``loss.png``) and
``dashboards.py`` (TensorBoard, Weights & Biases)."""
