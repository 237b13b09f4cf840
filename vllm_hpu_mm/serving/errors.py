"""The one exception the plugin's request checks raise."""

from __future__ import annotations

from vllm.exceptions import VLLMValidationError


class RequestRejected(VLLMValidationError, ValueError):
    """A request the plugin refuses before it reaches the engine core.

    ``vllm serve`` answers a ``VLLMValidationError`` with a 400 whose message is
    this one; a bare ``ValueError`` raised inside ``AsyncLLM.generate`` would
    instead become an empty 500. It is still a ``ValueError`` for callers of
    ``vllm.LLM`` that catch that.
    """
