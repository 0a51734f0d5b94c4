"""The release version: the one place it is written (pyproject.toml reads it, `pd-extproc --version`
prints it, /metrics exports it as pd_extproc_build_info, the image is tagged with it)."""

__version__ = "0.1.0"
