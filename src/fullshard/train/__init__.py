"""The trainer behind ``fullshard train`` (its command line is ``fullshard.cli.train``).

Read in this order: ``config/`` (what a run is: the dataclasses and presets, flags and
TOML, the paths it is given; ``fullshard/bounds.py``, shared with the other commands,
bounds its numbers), ``data.py`` (the text, its tokenizers, which windows each rank
reads), ``model.py`` (what is trained and how it is sharded), ``lora.py`` (adapters over a
frozen base), ``loop.py`` (one worker's run), ``checkpoints.py`` (saving, resuming,
restarts), ``report/`` (what a person sees), ``launch/`` (how the ranks come to exist and
agree) and ``export/`` (a run's checkpoint as a Hugging Face folder or peft adapters).
"""
