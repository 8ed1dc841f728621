"""The trainer (``fullshard train``), its GPT model, data and presets."""
