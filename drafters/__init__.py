"""Drafters propose tokens for the target to verify. They never import the engine."""

from .base import Draft, DraftContext, Drafter
from .prompt_lookup import PromptLookupDrafter, find_ngram_continuation

__all__ = ["Draft", "DraftContext", "Drafter", "PromptLookupDrafter", "find_ngram_continuation"]
