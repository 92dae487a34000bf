"""autotune: pick B/M, layer split and schedule for pipeline-parallel PyTorch training by simulation and real trials."""

__version__ = "0.1.0"
__all__ = ["__version__"]
