"""The package version: the one source pyproject.toml and ``autorecompute.__version__`` read."""
__version__ = "0.2.0"
