"""Structured output: spec.py (what SamplingParams carries), grammar.py (compiling and matching)."""
