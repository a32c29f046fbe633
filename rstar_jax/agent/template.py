"""The rStar2-Agent chat protocol as token ids: prompt, tools block, tool responses.

Strings follow the released training template character for character (rStar2 spec §2.1–2.2): the
system prompt with <reason>/<answer> instructions, a Hermes-style tools block, the user prefix that
demands <answer> and \\boxed{}, and a generation prompt that forces `<reason>`. The conversation is
built by appending encoded pieces, never by re-tokenizing it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Sequence

from rstar_jax.agent.conversation import Conversation, ConversationError, parse_conversation, with_tool_calls
from rstar_jax.agent.tokenizer import IM_END, IM_START, Tokenizer

DEFAULT_TOOL_NAME = "python_code_with_standard_io"

SYSTEM_PROMPT = (
    "A conversation between User and Assistant. The User asks a question, and the Assistant solves it. "
    "The Assistant first thinks about the reasoning process in the mind and then provides the User with the "
    "answer. The reasoning process is enclosed within <reason> </reason> and answer is enclosed within "
    "<answer> </answer> tags, respectively, i.e., <reason> reasoning process here </reason> <answer> answer "
    "here </answer>."
)
TOOLS_HEADER = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)
USER_PREFIX = (
    "You must put your answer inside <answer> </answer> tags, i.e., <answer> answer here </answer>. "
    "And your final answer will be extracted automatically by the \\boxed{} tag.\nThis is the problem:\n"
)
GENERATION_PROMPT = f"{IM_START}assistant\n<reason>"

TOOL_DESCRIPTION = (
    "Execute Python code with standard input and capture standard output. This function takes a Python code "
    "string and an input string, provides the input string through standard input (stdin) to the code, and "
    "captures and returns any output produced through standard output (stdout). If the executed code raises an "
    "exception, the error message will be captured and returned instead."
)
CODE_DESCRIPTION = (
    "A string containing Python code to be executed. The code can read from standard input using the input() function."
)
INPUT_DESCRIPTION = "A string that will be provided as standard input to the code when it calls input()."


def python_tool_schema(name: str = DEFAULT_TOOL_NAME) -> dict:
    """The release's tool schema (python_tool_config.yaml), keys in its order."""
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": TOOL_DESCRIPTION,
            "parameters": {
                "type": "object",
                "properties": {
                    "code": {"type": "string", "description": CODE_DESCRIPTION},
                    "input": {"type": "string", "description": INPUT_DESCRIPTION},
                },
                "required": ["code", "input"],
            },
        },
    }


def tool_json(schema: dict) -> str:
    # transformers' chat-template `tojson`: json.dumps with default separators, keys unsorted,
    # non-ASCII kept.
    return json.dumps(schema, ensure_ascii=False)


# The same protocol (tags, tool-call JSON, answer format) in ~190 characters instead of ~2.3K: for
# byte-level tiny models, where every character of the prompt is a token of every sequence.
COMPACT_SYSTEM_PROMPT = (
    "Think in <reason> </reason>, then give <answer> \\boxed{{}} </answer>. To run Python, write "
    '<tool_call>\n{{"name": "{tool}", "arguments": {{"code": "...", "input": ""}}}}\n</tool_call>'
)
COMPACT_NO_TOOL_PROMPT = "Think in <reason> </reason>, then give <answer> \\boxed{} </answer>."

TEMPLATE_STYLES = ("rstar2", "compact", "bare")


def _prompt_ids(template: "ChatTemplate", tokenizer: Tokenizer, question: str) -> tuple[int, ...]:
    return tuple(tokenizer.encode(template.system_text()) + tokenizer.encode(template.user_text(question))
                 + tokenizer.encode(GENERATION_PROMPT))


# A trainer process has a few hundred prompts in flight at most (a step's groups, 2G rollouts each).
_cached_prompt_ids = functools.lru_cache(maxsize=256)(_prompt_ids)


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """The chat protocol. Default: the release's strings exactly; `ChatTemplate.compact()` for tiny runs."""

    tool_name: str = DEFAULT_TOOL_NAME
    system_prompt: str = SYSTEM_PROMPT
    tools_block: bool = True  # the Hermes-style <tools> schema block after the system prompt
    user_prefix: str = USER_PREFIX

    @classmethod
    def compact(cls, tool_name: str = DEFAULT_TOOL_NAME) -> "ChatTemplate":
        return cls(tool_name=tool_name, system_prompt=COMPACT_SYSTEM_PROMPT.format(tool=tool_name),
                   tools_block=False, user_prefix="")

    @classmethod
    def bare(cls, tool_name: str = DEFAULT_TOOL_NAME) -> "ChatTemplate":
        """No system turn at all: the user's question, then the forced `<reason>`. For tiny models
        that learn the protocol from SFT alone, every prompt token saved is compute saved."""
        return cls(tool_name=tool_name, system_prompt="", tools_block=False, user_prefix="")

    @classmethod
    def from_style(cls, style: str, tool_name: str = DEFAULT_TOOL_NAME, *, tools: bool = True) -> "ChatTemplate":
        """The named style; `tools=False` leaves the tool out of the prompt (the no-tool ablation)."""
        if style == "rstar2":
            return cls(tool_name=tool_name, tools_block=tools)
        if style == "bare":
            return cls.bare(tool_name)
        if style == "compact":
            template = cls.compact(tool_name)
            return template if tools else dataclasses.replace(template, system_prompt=COMPACT_NO_TOOL_PROMPT)
        raise ValueError(f"unknown chat template style {style!r}; expected one of {TEMPLATE_STYLES}")

    @property
    def tools(self) -> list[dict]:
        return [python_tool_schema(self.tool_name)]

    def system_text(self) -> str:
        if not self.tools_block:
            return f"{IM_START}system\n{self.system_prompt}{IM_END}\n" if self.system_prompt else ""
        tools = "".join("\n" + tool_json(t) for t in self.tools)
        return f"{IM_START}system\n{self.system_prompt}{TOOLS_HEADER}{tools}{TOOLS_FOOTER}{IM_END}\n"

    def user_text(self, question: str) -> str:
        return f"{IM_START}user\n{self.user_prefix}{question}{IM_END}\n"

    def render_prompt(self, question: str) -> str:
        """The whole prompt text, ending in the forced `<|im_start|>assistant\\n<reason>`."""
        return self.system_text() + self.user_text(question) + GENERATION_PROMPT

    def prompt_ids(self, tokenizer: Tokenizer, question: str) -> list[int]:
        """`tokenizer.encode(render_prompt(question))`: the pieces meet only at `<|im_start|>`, a
        special token that BPE never merges across; the user turn alone is what varies per question.

        The last few prompts' ids are remembered per (template, tokenizer): a group's 2G rollouts
        share their prompt, and its system turn is the same for all (a few ms of encoding each)."""
        try:
            return list(_cached_prompt_ids(self, tokenizer, question))
        except TypeError:  # a tokenizer that cannot be a cache key (unhashable)
            return list(_prompt_ids(self, tokenizer, question))

    @staticmethod
    def tool_response_text(observation: str | Sequence[str]) -> str:
        """The user message carrying a turn's tool results, then the next forced `<reason>`.

        Several observations (several calls in one turn) each get their own <tool_response> block
        inside the one user message, as the release's template renders consecutive tool messages.
        """
        observations = [observation] if isinstance(observation, str) else list(observation)
        blocks = "".join(f"\n<tool_response>\n{obs}\n</tool_response>" for obs in observations)
        return f"{IM_START}user{blocks}{IM_END}\n{GENERATION_PROMPT}"

    def tool_response_ids(self, tokenizer: Tokenizer, observation: str | Sequence[str]) -> list[int]:
        """Ids appended after a turn's tool calls (loss mask 0), ending in the next forced `<reason>`.

        One encode of the whole rendered text, as the release tokenizes the tool messages: a BPE
        vocabulary merges an observation's edge whitespace with the template's `\\n` (bare stdout
        ending in "\\n" gives one `\\n\\n` token), which separately encoded pieces would not. The text
        starts at `<|im_start|>`, a special token, so appending these ids after a turn that ends in
        `<|im_end|>` equals tokenizing the concatenated text.
        """
        return tokenizer.encode(self.tool_response_text(observation))

    def sft_segments(self, conversation: Conversation | Sequence[dict]) -> list[tuple[str, bool]]:
        """Renders a solved conversation as (text, trained) segments for SFT, in the layout of an RL
        trajectory (encode each segment on its own, `conversation.encode_pieces`).

        The question, then assistant turns (content and/or structured tool calls, written in the
        Hermes form the rollout loop parses) with the tool results between them; a later user
        message starts a new exchange. Assistant text is trained with its closing `<|im_end|>`;
        everything else, including the forced `<reason>` that opens each assistant turn, is context.
        The template supplies the system prompt and the python tool, so a conversation bringing its
        own (a system message, tools) is refused: render those with the `qwen3` template.
        """
        if not isinstance(conversation, Conversation):
            conversation = parse_conversation({"messages": list(conversation)})
        messages = conversation.messages
        if conversation.tools:
            raise ConversationError("tools: the rstar2 template renders its own python tool; train conversations "
                                    "with their own tools with the qwen3 template (sft.templates)")
        if messages[0].role != "user":
            raise ConversationError(f"messages[0]: the rstar2 template needs the user's question first (its own "
                                    f"system prompt comes before it), got a {messages[0].role} message; use the "
                                    f"qwen3 template for conversations with a system prompt")
        segments: list[tuple[str, bool]] = [(self.system_text() + self.user_text(messages[0].content), False)]
        previous, i = "user", 1
        while i < len(messages):
            m = messages[i]
            if m.role == "assistant":
                if previous == "assistant":
                    raise ConversationError(f"messages[{i}]: two assistant messages in a row")
                if m.reasoning_content is not None:
                    raise ConversationError(f"messages[{i}].reasoning_content: the rstar2 template has no thinking "
                                            f"block (its reasoning is the <reason> text in content)")
                if previous == "user":
                    segments.append((GENERATION_PROMPT, False))
                segments.append((with_tool_calls(m.content, m.tool_calls) + IM_END, True))
            elif m.role == "tool":
                if previous != "assistant":
                    raise ConversationError(f"messages[{i}]: a tool message must follow an assistant turn")
                j = i
                while j < len(messages) and messages[j].role == "tool":
                    j += 1
                # The turn's results share one user message, ending in the next turn's forced <reason>.
                segments.append((self.tool_response_text([t.content for t in messages[i:j]]), False))
                i = j - 1
            elif m.role == "user":
                if previous != "assistant":
                    raise ConversationError(f"messages[{i}]: a user message must follow an assistant turn")
                segments.append((f"{IM_START}user\n{m.content}{IM_END}\n", False))
            else:
                raise ConversationError(f"messages[{i}]: a {m.role} message after the start; the rstar2 template "
                                        f"has one system prompt of its own")
            previous, i = m.role, i + 1
        return segments
