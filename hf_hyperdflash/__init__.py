"""HyperDFlash: block speculative decoding aligned with DeepSeek-V4's multi-stream mHC residual."""

__version__ = "0.1.0"
