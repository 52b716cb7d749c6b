"""Figures and widgets drawn from the live state of the engine."""
