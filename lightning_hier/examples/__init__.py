"""Runnable examples used by the README's main command and the example configs."""
