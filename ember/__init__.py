"""Ember: a self-hosted LLM inference platform."""

__version__ = "0.1.0"
