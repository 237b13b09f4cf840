"""Fakes of external stacks that behave as the real ones do (see each docstring)."""
