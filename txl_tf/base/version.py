"""The package's version (pyproject.toml's), importable without importing anything else of txl_tf."""

__version__ = "0.1.0"
