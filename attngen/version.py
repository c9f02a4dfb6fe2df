"""The package version: its one home (pyproject.toml reads it, generated headers print it)."""

__version__ = "0.1.0"
