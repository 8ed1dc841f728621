"""What a run is: ``schema.py`` (the dataclasses, one docstring per field, the presets,
TOML), ``flags.py`` (``--section.field`` flags and TOML values through tyro),
``paths.py`` (the files and directories a run is given, checked when read) and
``packages.py`` (the optional packages a configuration asks for, and their pip extras)."""
