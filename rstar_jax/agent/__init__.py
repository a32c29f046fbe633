"""The rStar2-Agent protocol: tokenizers, chat template, tool calls, reward and the counts RoC reads from text."""

from rstar_jax.agent.reward import SandboxScorer, VerifierPool, extract_answer, is_equivalent, make_scorer, score
from rstar_jax.agent.stats import count_answer_tags, is_tool_error, release_counts
from rstar_jax.agent.template import DEFAULT_TOOL_NAME, ChatTemplate, python_tool_schema
from rstar_jax.agent.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer
from rstar_jax.agent.tool_calls import ToolCall, ToolCallError, format_observation, parse_tool_calls

__all__ = [
    "SandboxScorer", "VerifierPool", "extract_answer", "is_equivalent", "make_scorer", "score",
    "count_answer_tags", "is_tool_error", "release_counts",
    "DEFAULT_TOOL_NAME", "ChatTemplate", "python_tool_schema",
    "ByteTokenizer", "HFTokenizer", "Tokenizer", "load_tokenizer",
    "ToolCall", "ToolCallError", "format_observation", "parse_tool_calls",
]
