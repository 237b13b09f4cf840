"""Developer tools that are not part of the installed plugin: the tiny
random-weights test models (``python -m tools.build_tiny_models``, run from the
repository root, as ``make models`` does)."""
