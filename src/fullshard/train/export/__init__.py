"""A run's checkpoint for other tools (``fullshard ckpt export``): ``hf.py`` (a Hugging
Face folder, ``--hf``) and ``adapters.py`` (LoRA adapters as peft loads them,
``--adapters``)."""
