"""The package's version: one place, read by the package's face and the command."""

__version__ = "0.1.0"
