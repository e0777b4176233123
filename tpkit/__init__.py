"""tpkit: tensor-parallel model layers, checkpoint loaders and paged attention for PyTorch."""

__version__ = "0.1.0"
