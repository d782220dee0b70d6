"""Caches that let the stock DeepSeek-V4 model take back rejected draft tokens."""

from .deepseek_v4 import RewindableDeepseekV4Cache

__all__ = ["RewindableDeepseekV4Cache"]
