"""SFT data as users have it: messages-format conversations (system prompts, multi-turn dialogue,
per-conversation tool schemas, structured tool calls) from jsonl and parquet, rendered with Qwen3's
stock chat template (checked against transformers' `apply_chat_template` with Qwen3's real
tokenizer and template) or the rStar2 template (the rollout loop's layout)."""

import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rstar_jax.agent.conversation import ConversationError, parse_conversation, qwen3_segments
from rstar_jax.agent.template import ChatTemplate
from rstar_jax.agent.tokenizer import IM_END, ByteTokenizer, HFTokenizer
from rstar_jax.agent.tool_calls import ToolCall, parse_tool_calls
from rstar_jax.config import REPO_CONFIGS, ConfigError, load_config_file, validate
from rstar_jax.data.datasets import DataError, read_conversations
from rstar_jax.app import builders
from rstar_jax.train.sft import SftSkips, conversation_ids, sft_sequences

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
                   "required": ["city"]}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "description": "Web search", "parameters": {"type": "object", "properties": {
        "query": {"type": "string"}}, "required": ["query"]}}}

# Shapes the paper's SFT mix has: function calling with its own tools (ToolACE / APIGen-MT / Glaive),
# instruction following (Tulu3), multi-turn chat (Llama-Nemotron), plus the edge cases of Qwen3's
# template (reasoning, consecutive tool results, arguments as a JSON string, later system messages).
ROWS = [
    {"messages": [
        {"role": "system", "content": "You are a travel assistant."},
        {"role": "user", "content": "Weather in Paris and Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "C"}'}}]},
        {"role": "tool", "content": "sunny, 22°C\n"},
        {"role": "tool", "content": "  rain, 9°C"},
        {"role": "assistant", "content": "Paris is sunny (22°C); Oslo has rain (9°C).\n"},
        {"role": "user", "content": "Search flights then."},
        {"role": "assistant", "content": "Searching.", "tool_calls": [
            {"type": "function", "function": {"name": "search", "arguments": {"query": "Paris→Oslo 🛫"}}}]},
        {"role": "tool", "content": "3 results"},
        {"role": "assistant", "content": "I found 3 flights."}], "tools": [WEATHER, SEARCH]},
    {"messages": [{"role": "user", "content": "Write a haiku about rain."},
                  {"role": "assistant", "content": "Soft rain on tin\nwhispers the night\npuddles keep the moon"}]},
    {"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"},
        {"role": "system", "content": "Now answer in French."},
        {"role": "user", "content": [{"type": "text", "text": "And 3+3?"}]},
        {"role": "assistant", "content": "Six.", "reasoning_content": "trois plus trois"}]},
    {"messages": [{"role": "user", "content": "Look up jax"},
                  {"role": "assistant", "tool_calls": [{"name": "search", "arguments": {"query": "jax"}}]},
                  {"role": "tool", "content": ""},
                  {"role": "assistant", "content": "\n\nNothing found."}],
     "tools": json.dumps([SEARCH])},  # schemas stored as one JSON string, as many datasets do
]


def _reference_mask(hf, text: str) -> list[int]:
    """Independent of our renderer: the assistant message bodies in transformers' own rendering
    (after `<|im_start|>assistant\\n`, through `<|im_end|>`), mapped to tokens by its offsets."""
    spans = [(m.start(1), m.end(1)) for m in re.finditer(r"<\|im_start\|>assistant\n(.*?<\|im_end\|>)", text, re.S)]
    encoding = hf(text, add_special_tokens=False, return_offsets_mapping=True)
    return [int(any(a <= start < b for a, b in spans)) for start, _ in encoding["offset_mapping"]]


def _parquet_row(row: dict) -> dict:
    """A row as parquet holds it: one schema per column, so call arguments and tool schemas are JSON
    strings, text parts are joined and absent fields are null."""
    def call(c):
        function = c.get("function") or c
        arguments = function["arguments"]
        return {"type": "function", "function": {"name": function["name"], "arguments": arguments if isinstance(
            arguments, str) else json.dumps(arguments, ensure_ascii=False)}}

    def message(m):
        content = m.get("content")
        return {"role": m["role"], "reasoning_content": m.get("reasoning_content"),
                "content": "".join(p["text"] for p in content) if isinstance(content, list) else content,
                "tool_calls": [call(c) for c in m["tool_calls"]] if m.get("tool_calls") else None}

    tools = row.get("tools")
    return {"messages": [message(m) for m in row["messages"]],
            "tools": tools if tools is None or isinstance(tools, str) else json.dumps(tools, ensure_ascii=False)}


def _write(path, rows, fmt):
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    else:
        pq.write_table(pa.Table.from_pylist([_parquet_row(r) for r in rows]), path)
    return path


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_qwen3_template_sft_equals_apply_chat_template_and_trains_only_assistant_tokens(tmp_path, fmt,
                                                                                         qwen3_tokenizer_dir):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(qwen3_tokenizer_dir)
    ours = HFTokenizer(qwen3_tokenizer_dir)
    conversations, report = read_conversations(_write(tmp_path / f"general.{fmt}", ROWS, fmt))
    assert report.rows_kept == len(ROWS)
    sequences = sft_sequences(ChatTemplate(), ours, conversations, max_length=4096, style="qwen3")
    assert len(sequences) == len(ROWS)
    for row, sequence in zip(ROWS, sequences):
        tools = json.loads(row["tools"]) if isinstance(row.get("tools"), str) else row.get("tools")
        messages = [{**m, "content": "".join(p["text"] for p in m["content"])} if isinstance(m.get("content"), list)
                    else m for m in row["messages"]]
        text = hf.apply_chat_template(messages, tools=tools, tokenize=False)
        expected = hf.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True)["input_ids"]
        ids = sequence.prompt_ids + sequence.response_ids
        assert ids == list(expected), ours.decode(ids)
        assert [0] + sequence.loss_mask == _reference_mask(hf, text)
    # The trained text of the tool-calling conversation: every assistant message, calls included.
    trained = ours.decode([i for i, m in zip(sequences[0].response_ids, sequences[0].loss_mask) if m])
    assert trained.count(IM_END) == 4
    assert '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}' in trained
    assert "You are a travel assistant" not in trained and "sunny" not in trained.split(IM_END)[0]


def test_qwen3_rendering_of_the_byte_tokenizer_keeps_the_mask_on_assistant_text():
    conversation = parse_conversation(ROWS[2])
    ids, mask = conversation_ids(ChatTemplate(), ByteTokenizer(), conversation, "qwen3")
    text = "".join(t for t, _ in qwen3_segments(conversation))
    assert ByteTokenizer().decode(ids) == text
    trained = ByteTokenizer().decode([i for i, m in zip(ids, mask) if m])
    # Earlier turns drop their thinking; the turn after the last question shows it.
    assert trained == f"Hello.{IM_END}4{IM_END}<think>\ntrois plus trois\n</think>\n\nSix.{IM_END}"


def test_rstar2_template_renders_structured_calls_as_the_rollout_loop_reads_them():
    template, tok = ChatTemplate(), ByteTokenizer()
    conversation = {"messages": [
        {"role": "user", "content": "What is 7^5 mod 13?"},
        {"role": "assistant", "content": "Compute it.</reason>", "tool_calls": [{"type": "function", "function": {
            "name": "python_code_with_standard_io", "arguments": {"code": "print(pow(7, 5, 13))", "input": ""}}}]},
        {"role": "tool", "content": "Tool call success\nstdout: 11\n"},
        {"role": "assistant", "content": "</reason>\n<answer>\\boxed{11}</answer>"}]}
    segments = template.sft_segments(parse_conversation(conversation))
    text = "".join(t for t, _ in segments)
    assert text.startswith(template.render_prompt("What is 7^5 mod 13?"))
    assert segments[1] == ("<|im_start|>assistant\n<reason>", False)
    first_turn, trained = segments[2]
    assert trained and first_turn.endswith(IM_END)
    assert parse_tool_calls(first_turn, tool_names=(template.tool_name,)) == [
        ToolCall("python_code_with_standard_io", "print(pow(7, 5, 13))", "")]
    assert segments[3] == (template.tool_response_text("Tool call success\nstdout: 11\n"), False)
    ids, mask = conversation_ids(template, tok, conversation["messages"], "rstar2")
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == (
        first_turn + "</reason>\n<answer>\\boxed{11}</answer>" + IM_END)
    assert tok.decode(ids) == text
    # Consecutive tool results share one user turn, as the rollout loop appends a turn's results.
    results = [{"role": "tool", "content": "a"}, {"role": "tool", "content": "b"}]
    two = {"messages": [*conversation["messages"][:2], *results, conversation["messages"][3]]}
    assert template.sft_segments(parse_conversation(two))[3] == (template.tool_response_text(["a", "b"]), False)
    for row, message in [(ROWS[2], r"messages\[0\]: the rstar2 template needs the user's question first"),
                         (ROWS[3], r"tools: the rstar2 template renders its own python tool")]:
        with pytest.raises(ConversationError, match=message):
            template.sft_segments(parse_conversation(row))


def test_bad_conversations_name_file_row_and_field(tmp_path):
    cases = {
        '{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [{"function": {}}]}]}':
            r"row 0 \(line 1\): messages\[1\]\.tool_calls\[0\]: expected \{function: \{name",
        '{"messages": [{"role": "user", "content": 3}]}': r"messages\[0\]\.content: expected a string, got int",
        '{"messages": [{"role": "user", "content": "q"}], "tools": "[oops"}': r"tools: not valid JSON",
        '{"messages": [{"role": "tool", "content": "x", "tool_calls": [{"name": "f"}]}]}':
            r"messages\[0\]\.tool_calls: only assistant messages make tool calls",
        '{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}]}':
            r"messages\[1\]: an assistant message needs content or tool_calls",
    }
    for line, message in cases.items():
        (tmp_path / "bad.jsonl").write_text(line + "\n")
        with pytest.raises(DataError, match=message):
            read_conversations(tmp_path / "bad.jsonl")
    (tmp_path / "mixed.jsonl").write_text("\n".join([json.dumps(ROWS[1]), *cases]) + "\n")
    kept, report = read_conversations(tmp_path / "mixed.jsonl", on_bad_row="skip")
    assert len(kept) == 1 and report.skipped == {"bad_conversation": len(cases)}


def test_sft_files_take_their_template_and_skip_overlong_conversations(tmp_path, capsys):
    config = load_config_file(REPO_CONFIGS / "tiny.py")
    general = _write(tmp_path / "general.jsonl", ROWS, "jsonl")
    solved = {"messages": [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "\\boxed{2}"}]}
    math = _write(tmp_path / "math.jsonl", [solved] * 4, "jsonl")
    config.update_from_flattened_dict({"data.synthetic.enabled": False, "sft.train_files": (str(general), str(math)),
                                       "sft.templates": ("qwen3", "rstar2"), "sft.max_length": 512,
                                       "sft.batch_size": 2, "sft.advance_exact": 0.0})  # no conversation held out
    validate(config, check_files=False)
    tok, template = builders.tokenizer(config), builders.template(config)
    batches = builders.sft_batches(config, tok, template, config.sft.train_files, None)
    lengths = {len(conversation_ids(template, tok, c, "qwen3")[0]) for c in read_conversations(general)[0]}
    overlong = sum(n > 512 for n in lengths)
    assert overlong and len(batches.sequences) == len(ROWS) - overlong + 4
    assert f"general.jsonl: skipped {overlong} of {len(ROWS)} conversations {{'overlong': {overlong}}}" in \
        capsys.readouterr().out
    # The rstar2 file renders with the run's RL prompt (tiny: the bare template, question then <reason>).
    assert ByteTokenizer().decode(batches.sequences[-1].response_ids).startswith("user\n1+1?")
    config.sft.max_length = 64
    with pytest.raises(DataError, match=r"general\.jsonl: no conversation left to train on \({'overlong': 4}"):
        builders.sft_batches(config, tok, template, config.sft.train_files, None)
    config.sft.max_length, config.sft.templates = 512, ("rstar2",)
    with pytest.raises(DataError, match=r"general\.jsonl row 0 \(line 1\): tools: the rstar2 template renders its "
                                        r"own python tool.*\(sft\.templates renders this file with 'rstar2'\)"):
        builders.sft_batches(config, tok, template, config.sft.train_files, None)
    for templates, message in [(("qwen3", "chatml"), r"sft\.templates: each must be one of \('rstar2', 'qwen3'\)"),
                               (("qwen3", "rstar2", "qwen3"), r"sft\.templates: one template for all files or one "
                                                              r"per file \(2 in sft\.train_files\), got 3")]:
        config.sft.templates = templates
        with pytest.raises(ConfigError, match=message):
            validate(config, check_files=False)
    assert SftSkips().total == 0


def test_a_stage_too_small_to_hold_out_its_measurement_is_refused(tmp_path):
    """sft.advance_exact holds out the last sft.advance_probe conversations of each stage but the
    last; a stage with no more than that is refused, naming the field and the file."""
    from rstar_jax.errors import ConfigError

    config = load_config_file(REPO_CONFIGS / "tiny.py")
    solved = {"messages": [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "\\boxed{2}"}]}
    first = _write(tmp_path / "first.jsonl", [solved] * 8, "jsonl")
    last = _write(tmp_path / "last.jsonl", [solved] * 2, "jsonl")
    config.update_from_flattened_dict({"data.synthetic.enabled": False, "sft.train_files": (str(first), str(last)),
                                       "sft.batch_size": 2, "sft.advance_probe": 8})
    tok, template = builders.tokenizer(config), builders.template(config)
    with pytest.raises(ConfigError, match=r"config\.sft\.advance_probe: holds out 8 conversations of .*first\.jsonl "
                                          r"to measure sft\.advance_exact on, but it has only 8 to train on"):
        builders.sft_batches(config, tok, template, config.sft.train_files, None)
    config.sft.advance_probe = 3
    batches = builders.sft_batches(config, tok, template, config.sft.train_files, None)
    assert batches.stage_sizes == (5, 2) and [len(h) for h in batches.held_out] == [3, 0]
