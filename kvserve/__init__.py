"""kvserve: an OpenAI-compatible inference server that makes repeated context cheap."""

from kvserve.config import ServeConfig
from kvserve.llm import LLM
from kvserve.request import SamplingParams

__all__ = ["LLM", "SamplingParams", "ServeConfig"]
__version__ = "0.1.0"
