"""The trainer behind ``fullshard train`` (its command line is ``fullshard.cli.train``).

Read in this order: ``config.py`` (what a run is: dataclasses, presets, TOML; ``flags.py``
parses flags and TOML values with tyro; ``paths.py`` checks files, and
``fullshard/bounds.py``, shared with the other commands, numbers), ``data.py`` (the text,
its tokenizers, which windows each rank reads), ``model.py`` (what is trained and how it is sharded), ``loop.py`` (one worker's run),
``checkpoints.py`` (saving, resuming, restarts), ``metrics.py``, ``progress.py``,
``plot.py`` and ``dashboards.py`` (what a person sees; ``packages.py``: the optional
packages they need), ``launch.py`` (how the ranks come to exist). ``hf_export.py``: a
run's checkpoint as a Hugging Face folder (``fullshard ckpt export --hf``).
"""
