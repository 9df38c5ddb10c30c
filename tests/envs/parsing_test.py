"""Hand cases for `parse_step`: one test per rule of the Qwen/Hermes step format."""

from __future__ import annotations

import json

from tree_rl.envs.base import ToolError
from tree_rl.envs.parsing import MAX_NAME_CHARS, format_tool_call, parse_step

CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


def _step(*blocks: str, think: str = "plan") -> str:
  return f"<think>{think}</think>\n" + "\n".join(f"<tool_call>\n{b}\n</tool_call>" for b in blocks)


def test_think_only_is_a_text_answer():
  step = parse_step("<think> I know this. </think>\nThe capital is Paris.")
  assert step.think == " I know this. "
  assert step.num_tool_call_blocks == 0 and step.calls == ()
  assert not step.json_ok and not step.fields_ok
  assert step.answer == "The capital is Paris."


def test_no_think_block():
  step = parse_step("Just an answer.")
  assert step.think is None
  assert step.answer == "Just an answer."
  # An opened but never closed think block is not a think block.
  assert parse_step("<think>still thinking").think is None


def test_one_call():
  step = parse_step(_step(CALL))
  assert step.num_tool_call_blocks == 1
  (call,) = step.calls
  assert call.name == "get_weather" and call.arguments == {"city": "Paris"}
  assert call.error is None and call.raw.strip() == CALL  # raw: the block as written
  assert step.json_ok and step.fields_ok
  assert step.answer == ""


def test_list_of_calls_in_one_block():
  block = json.dumps([{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": 1}}])
  step = parse_step(_step(block))
  assert step.num_tool_call_blocks == 1
  assert [c.name for c in step.calls] == ["a", "b"]
  assert step.calls[1].arguments == {"x": 1}
  assert json.loads(step.calls[1].raw) == {"name": "b", "arguments": {"x": 1}}
  assert step.json_ok and step.fields_ok


def test_two_blocks():
  step = parse_step(_step(CALL, '{"name": "now", "arguments": {}}'))
  assert step.num_tool_call_blocks == 2
  assert [c.name for c in step.calls] == ["get_weather", "now"]
  assert step.fields_ok


def test_empty_list_is_zero_calls():
  step = parse_step(_step("[]"))
  assert step.num_tool_call_blocks == 1 and step.calls == ()
  assert step.json_ok and step.fields_ok  # vacuously


def test_broken_json_reports_position():
  step = parse_step(_step('{"name": "f", "arguments": {"x": 1,}}'))
  (call,) = step.calls
  assert call.error == ToolError.PARSE and call.name is None and call.arguments is None
  assert "line 1 column" in call.error_message and "char" in call.error_message
  assert not step.json_ok and not step.fields_ok


def test_nan_and_empty_block_are_parse_errors():
  nan = parse_step(_step('{"name": "f", "arguments": {"x": NaN}}'))
  assert nan.calls[0].error == ToolError.PARSE and "NaN" in nan.calls[0].error_message
  empty = parse_step("<think>x</think><tool_call>  </tool_call>")
  assert empty.calls[0].error == ToolError.PARSE and "empty" in empty.calls[0].error_message


def test_missing_arguments_is_format_error():
  step = parse_step(_step('{"name": "f"}'))
  (call,) = step.calls
  assert call.error == ToolError.FORMAT and call.name == "f"
  assert '"arguments"' in call.error_message
  assert step.json_ok and not step.fields_ok


def test_non_string_name_and_non_object_arguments():
  step = parse_step(_step('{"name": 7, "arguments": {"a": 1}}', '{"name": "g", "arguments": "{}"}'))
  first, second = step.calls
  assert first.error == ToolError.FORMAT and first.name is None and '"name"' in first.error_message
  assert second.error == ToolError.FORMAT and second.name == "g" and second.arguments is None
  assert "must be a JSON object, got string" in second.error_message
  assert step.json_ok and not step.fields_ok


def test_wrong_top_level_types():
  step = parse_step(_step('"get_weather"', '[{"name": "a", "arguments": {}}, [1], null]'))
  assert [c.error for c in step.calls] == [ToolError.FORMAT, None, ToolError.FORMAT,
                                           ToolError.FORMAT]
  assert "list element 1" in step.calls[2].error_message
  assert step.json_ok and not step.fields_ok


def test_unterminated_final_block():
  step = parse_step(_step(CALL) + '\n<tool_call>\n{"name": "f", "argum')
  assert step.num_tool_call_blocks == 2
  assert step.calls[0].error is None
  assert step.calls[1].error == ToolError.PARSE and "not closed" in step.calls[1].error_message
  assert not step.json_ok


def test_opening_tag_before_close_starts_a_new_block():
  step = parse_step(f"<think>x</think><tool_call>{CALL}<tool_call>{CALL}</tool_call>")
  assert step.num_tool_call_blocks == 2
  assert step.calls[0].error == ToolError.PARSE and step.calls[1].error is None


def test_code_fence_is_tolerated():
  for fence in (f"```json\n{CALL}\n```", f"```\n{CALL}\n```", f"```JSON {CALL}```"):
    step = parse_step(_step(fence))
    assert step.fields_ok, fence
    assert step.calls[0].arguments == {"city": "Paris"}


def test_answer_tag_wins_over_free_text():
  step = parse_step("<think>easy</think>So: <answer> 42 </answer> done.")
  assert step.answer == "42"
  assert parse_step("<think>a</think> The answer is 42. ").answer == "The answer is 42."


def test_tags_inside_think_are_reasoning():
  text = f"<think>maybe <tool_call>{CALL}</tool_call> or <answer>1</answer></think>Final: 2"
  step = parse_step(text)
  assert step.num_tool_call_blocks == 0 and step.answer == "Final: 2"
  # Only the first complete think block is the think; a nested opening tag is content.
  nested = parse_step("<think>a<think>b</think>c</think>")
  assert nested.think == "a<think>b" and nested.answer == "c</think>"


def test_text_around_calls_is_the_answer():
  step = parse_step(f"<think>t</think>Let me look.<tool_call>{CALL}</tool_call>Then more.")
  assert step.answer == "Let me look.\nThen more."
  assert step.calls[0].name == "get_weather"


def test_unicode_and_huge_inputs_do_not_raise():
  step = parse_step(_step('{"name": "搜索", "arguments": {"q": "Zürich 🌧"}}'))
  assert step.calls[0].name == "搜索" and step.calls[0].arguments == {"q": "Zürich 🌧"}
  deep = parse_step(_step("[" * 50_000 + "]" * 50_000))
  assert deep.calls[0].error == ToolError.PARSE and not deep.json_ok
  digits = parse_step(_step('{"name": "f", "arguments": {"n": ' + "9" * 10_000 + "}}"))
  assert digits.calls[0].error == ToolError.PARSE
  big = parse_step("<tool_call>" * 20_000 + "x" * 1_000_000)
  assert big.num_tool_call_blocks == 20_000 and not big.json_ok


def test_format_tool_call_round_trips():
  text = "<think>x</think>\n" + format_tool_call("f", {"city": "Zürich", "n": [1, 2]})
  assert "Zürich" in text  # not ASCII-escaped
  step = parse_step(text)
  assert step.fields_ok and step.calls[0].name == "f"
  assert step.calls[0].arguments == {"city": "Zürich", "n": [1, 2]}


def test_lone_surrogates_become_replacement_characters_and_names_are_capped():
  """JSON's "\\ud800" decodes to a lone surrogate, which no UTF-8 writer accepts: a tool
  name or argument holding one once killed every eval's transcript (on every resume).
  Valid pairs ("\\ud83d\\ude00") stay the character they spell."""
  text = ('<tool_call>{"name": "\\ud800calc", "arguments": {"\\udfffx": '
          '["\\ud83d\\ude00 ok", "\\udc00", 3]}}</tool_call>')
  (call,) = parse_step(text).calls
  assert call.error is None
  assert call.name == "\ufffdcalc"
  assert call.arguments == {"\ufffdx": ["\U0001F600 ok", "\ufffd", 3]}
  json.dumps({"name": call.name, "arguments": call.arguments},
             ensure_ascii=False).encode("utf-8")  # encodes: nothing left to fail
  long = parse_step('<tool_call>{"name": "' + "a" * 5000 + '", "arguments": {}}</tool_call>')
  assert len(long.calls[0].name) == MAX_NAME_CHARS
