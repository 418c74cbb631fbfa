"""textbox_like: distributed training on heterogeneous infrastructure, on Accelerate."""
__version__ = "0.1.0"
