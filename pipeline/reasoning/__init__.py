"""Reasoning output (``--reasoning-parser``): an answer's text split into the reasoning inside
``<think>...</think>`` (OpenAI's ``reasoning_content``) and the content after it, whole or as
it streams. A leaf package: it imports nothing of ours.

- base: ``ReasoningParser`` (``extract``, ``feed``/``finish``, ``in_reasoning``), the
  think-tag matching and its held-back partial tags
- parsers: ``deepseek_r1`` and ``qwen3``, ``REASONING_PARSERS``, ``get_reasoning_parser``
"""
from pipeline.reasoning.base import ReasoningParser
from pipeline.reasoning.parsers import REASONING_PARSERS, get_reasoning_parser

__all__ = ["REASONING_PARSERS", "ReasoningParser", "get_reasoning_parser"]
