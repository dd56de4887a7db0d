"""Activation transforms (issue 3): memory-efficient Swish/Mish/Hard-Swish and BatchNorm+activation recompute."""
