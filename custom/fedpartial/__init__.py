"""fedpartial: federated medical image classification with missing / partial labels on NVIDIA FLARE."""

__version__ = "0.1.0"
