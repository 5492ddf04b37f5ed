"""Shared by the path set-ups."""


class PathSkipped(Exception):
    """The path cannot run in this environment (not an error of the path itself)."""
