"""The transforms, one file per family. Importing this package registers their plan steps."""

from . import activations, checkpoint, precision  # noqa: F401  (registers the steps)
