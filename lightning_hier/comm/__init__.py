"""Collectives and plans (no Lightning here)."""
