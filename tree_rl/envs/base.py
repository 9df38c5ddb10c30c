"""The environment contract: tools, parsed model steps, tasks, outcomes and task families.

Everything here is host-side plain Python. Messages are OpenAI-style dicts
({"role": "system" | "user" | "assistant" | "tool", "content": str, ...}) so they
can be rendered by any chat template and sent to any OpenAI-compatible judge.

An episode is a list of such messages: the task's prompt messages, then for each
step one assistant message (the exact text the model produced) followed by one
tool message per tool call of that step. The episode ends when a step makes no
tool call (its text is the final answer), when it calls a terminal tool
(`response_gen` in the tool world; its arguments hold the answer), or at the
family's turn limit (the episode is then truncated).
"""

from __future__ import annotations

import dataclasses
import json
import enum
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

Message = dict[str, Any]


class ToolError(enum.StrEnum):
  """Why a tool call failed; the model reads the message, the metrics read the kind."""

  PARSE = "parse"  # the <tool_call> block is not valid JSON
  FORMAT = "format"  # valid JSON but not {"name": str, "arguments": object}
  UNKNOWN_TOOL = "unknown_tool"
  INVALID_ARGUMENTS = "invalid_arguments"  # schema violation: missing, mistyped, extra
  EXCEPTION = "exception"  # the tool raised (e.g. the world has no such entity)
  TIMEOUT = "timeout"


@dataclasses.dataclass(frozen=True)
class Tool:
  """A callable tool: a name, an OpenAI-style JSON schema and a function.

  `fn` is called with the validated arguments as keyword arguments and returns a
  string or a JSON-serialisable value (rendered with `json.dumps`). It signals a
  domain error (unknown city, no such ticker) by raising `ValueError`/`KeyError`;
  the executor turns that into a tool error message.

  Attributes:
    name: tool name the model writes in "name".
    description: one or two sentences the model reads.
    parameters: JSON schema of the arguments ({"type": "object", "properties":
      {...}, "required": [...]}). BFCL's "dict"/"float"/"tuple" type names are
      accepted as aliases of object/number/array.
    fn: the implementation.
    timeout_s: wall-clock limit of one call.
    terminal: a call to this tool ends the episode (PORTool's `response_gen`).
  """

  name: str
  description: str
  parameters: Mapping[str, Any]
  fn: Callable[..., Any]
  timeout_s: float = 10.0
  terminal: bool = False

  def schema(self) -> dict[str, Any]:
    """The OpenAI/Hermes function schema the prompt lists."""
    return {"type": "function",
            "function": {"name": self.name, "description": self.description,
                         "parameters": dict(self.parameters)}}


@dataclasses.dataclass(frozen=True)
class ToolCall:
  """One call parsed from a model step. `error` is set when it could not be parsed."""

  name: str | None
  arguments: Mapping[str, Any] | None
  raw: str  # the text it came from (one <tool_call> block, or one element of its list)
  error: ToolError | None = None
  error_message: str | None = None


@dataclasses.dataclass(frozen=True)
class ToolResult:
  """What one call returned: `content` is the tool message the model reads."""

  name: str | None
  content: str
  ok: bool
  error: ToolError | None = None
  seconds: float = 0.0


@dataclasses.dataclass(frozen=True)
class ParsedStep:
  """One assistant step, split into its parts (Qwen/Hermes convention).

  Attributes:
    text: the full step text.
    think: the content of the first <think>...</think> block, None if absent.
    num_tool_call_blocks: number of <tool_call>...</tool_call> blocks (an
      unterminated final block counts and fails to parse).
    calls: every call, in order; one block may hold one call object or a JSON
      list of calls (PORTool's convention).
    json_ok: every block parsed as JSON (False when there is no block).
    fields_ok: json_ok and every call has a string "name" and an object "arguments".
    answer: the text outside think and tool_call blocks, stripped (the free-text
      answer of a step without calls); the content of an <answer>...</answer>
      block when one is present.
  """

  text: str
  think: str | None
  num_tool_call_blocks: int
  calls: tuple[ToolCall, ...]
  json_ok: bool
  fields_ok: bool
  answer: str


@dataclasses.dataclass(frozen=True)
class Task:
  """One prompt with its ground truth.

  Attributes:
    task_id: unique within the family, stable for a seed (e.g. "toolworld/train/17").
    family: the family name.
    split: "train" or "eval"; splits never share a task.
    messages: the prompt (system message with the tool list, then the user turn).
    tool_names: the tools offered in this task (a subset of the family's).
    answer: the ground truth the verifier compares with (JSON-serialisable).
    oracle: assistant/tool messages of one correct episode, in order (SFT warm start).
    difficulty: number of tool-call steps the oracle needs.
    metadata: family-specific extras (the world seed, the current date, ...).
  """

  task_id: str
  family: str
  split: str
  messages: tuple[Message, ...]
  tool_names: tuple[str, ...]
  answer: Any
  oracle: tuple[Message, ...] = ()
  difficulty: int = 1
  metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Outcome:
  """A verifier's verdict on one episode.

  Attributes:
    reward: the family's outcome reward (tool world: +1 correct, 0 unable to
      answer, -1 wrong or truncated; AWPO: S_format + S_exec in [0, 2]; math/QA:
      1 or 0, or F1 for QA when configured).
    correct: counted as correct for accuracy.
    answered: a final answer was given (False: "unable to answer" or truncated).
    details: per-family diagnostics (extracted answer, F1, S_exec, ...).
  """

  reward: float
  correct: bool
  answered: bool
  details: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@runtime_checkable
class TaskFamily(Protocol):
  """A source of tasks, their tools and their verifier."""

  name: str
  max_turns: int  # assistant steps per episode; BFCL is single-step (1)

  def generate(self, split: str, num_tasks: int, seed: int) -> list[Task]:
    """`num_tasks` tasks of `split`, deterministic in (split, num_tasks, seed)."""
    ...

  def tools(self, task: Task) -> list[Tool]:
    """The tools bound to this task's world (the ones named in `task.tool_names`)."""
    ...

  def score(self, task: Task, episode: Sequence[Message], truncated: bool) -> Outcome:
    """The outcome of one finished or truncated episode (prompt messages included)."""
    ...


TOOL_PROMPT_TEMPLATE = """{preamble}

# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tool_lines}
</tools>

In every step, first think inside <think></think> tags. Then, to call functions, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>
{finish}"""


def render_tool_prompt(tools: Sequence[Tool], preamble: str, finish: str) -> str:
  """The system message text listing `tools` in the Qwen/Hermes convention.

  Args:
    tools: the tools offered.
    preamble: the task-family instructions that come first.
    finish: how to end the episode (e.g. "Give the final answer by calling
      response_gen." or "Give the final answer inside <answer></answer>.").
  """

  lines = "\n".join(json.dumps(t.schema(), ensure_ascii=False) for t in tools)
  return TOOL_PROMPT_TEMPLATE.format(preamble=preamble.strip(), tool_lines=lines,
                                     finish=finish.strip())


# Tool replies longer than this many tokens are cut (a family's `max_tool_output_tokens`).
DEFAULT_MAX_TOOL_OUTPUT_TOKENS = 512
# The marker alone takes ~10 tokens; a cap below this would leave no room for the reply.
MIN_TOOL_OUTPUT_TOKENS = 32
# Without a tokenizer a token is taken to be this many characters (a rough English average).
CHARS_PER_TOKEN = 4
# Characters per token no tokenizer exceeds in practice: with a tokenizer, text past
# max_tokens * this is cut before it is tokenized, so a 1 MB reply costs no 1 MB encode.
MAX_CHARS_PER_TOKEN = 16


def truncation_marker(cut_chars: int) -> str:
  """The text that ends a cut tool reply: how much the model did not see, so it can learn
  to ask for less (a narrower query, a shorter print)."""
  return f"\n... [truncated: {cut_chars} more characters]"


def check_max_tool_output_tokens(value: Any, where: str = "max_tool_output_tokens") -> int:
  """`value` as a token cap; a ValueError naming `where` unless it is an int >= 32."""
  if isinstance(value, bool) or not isinstance(value, int) or value < MIN_TOOL_OUTPUT_TOKENS:
    raise ValueError(f"{where}={value!r} must be an integer >= {MIN_TOOL_OUTPUT_TOKENS} "
                     f"(the truncation marker alone takes about 10 tokens)")
  return value


def family_max_tool_output_tokens(family: Any) -> int:
  """The tool reply cap of `family`: its `max_tool_output_tokens` attribute (set by
  `make_family`), else DEFAULT_MAX_TOOL_OUTPUT_TOKENS (families built directly, in tests)."""
  value = getattr(family, "max_tool_output_tokens", DEFAULT_MAX_TOOL_OUTPUT_TOKENS)
  return check_max_tool_output_tokens(value, f"{type(family).__name__}.max_tool_output_tokens")


@dataclasses.dataclass(frozen=True)
class ToolOutputCap:
  """Cuts one tool reply to at most `max_tokens` tokens, ending it with `truncation_marker`.

  A tool reply becomes env tokens in the context, so one huge reply (a 1 MB search
  result, a print in a loop) would fill the window in one step. Both harnesses cap
  every reply (successes and errors) with the same cap, built from the same tokenizer,
  so evaluation and training show the model the same text: the rollout (`Forest`)
  with its chat format's `encode`, the evaluation harness (`run_episodes`) with the
  `encode` its caller passes.

  With `encode`, the kept part is the longest prefix whose text plus marker encodes to
  at most `max_tokens` tokens (a binary search over the prefix length; text past
  `max_tokens * MAX_CHARS_PER_TOKEN` characters is dropped before any encoding).
  Without one, `max_tokens * CHARS_PER_TOKEN` characters stand in for the token count.
  The count is of the reply alone: inside the chat template, merges across its edges
  may shift it by a token.

  Attributes:
    max_tokens: the cap (>= MIN_TOOL_OUTPUT_TOKENS).
    encode: text -> token ids (without special tokens); None: count characters.
  """

  max_tokens: int = DEFAULT_MAX_TOOL_OUTPUT_TOKENS
  encode: Callable[[str], Sequence[int]] | None = None

  def __post_init__(self):
    check_max_tool_output_tokens(self.max_tokens)

  def _cut(self, text: str, keep: int) -> str:
    return text[:keep] + truncation_marker(len(text) - keep)

  def __call__(self, text: str) -> str:
    """`text` if it fits, else its longest fitting prefix followed by the marker."""
    if self.encode is None:
      limit = self.max_tokens * CHARS_PER_TOKEN
      if len(text) <= limit:
        return text
      # The marker of the largest possible cut is at least as long as the real one.
      return self._cut(text, max(0, limit - len(truncation_marker(len(text)))))
    limit = self.max_tokens * MAX_CHARS_PER_TOKEN
    if len(text) <= limit and len(self.encode(text)) <= self.max_tokens:
      return text
    lo, hi = 0, min(len(text), limit)
    while lo < hi:  # the largest prefix that fits (0 fits: the marker alone is ~10 tokens)
      mid = (lo + hi + 1) // 2
      if len(self.encode(self._cut(text, mid))) <= self.max_tokens:
        lo = mid
      else:
        hi = mid - 1
    return self._cut(text, lo)


def render_tool_output(value: Any) -> str:
  """The tool message text of a tool's return value: strings as they are, else JSON."""
  if isinstance(value, str):
    return value
  return json.dumps(value, ensure_ascii=False, sort_keys=True)


def tool_error_text(kind: ToolError, message: str) -> str:
  """The tool message text of a failed call; the model reads it, so it names the problem."""
  return f"Error [{kind.value}]: {message}"
