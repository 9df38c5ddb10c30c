"""Chat templates in token space: prompt tokens, and the glue between turns.

The agent loop never re-tokenizes what the model sampled. After a policy step it
appends *glue* tokens: whatever the chat template puts after an assistant turn's
content (its end-of-turn marker, unless the model already sampled it), the tool
turns, and the header of the next assistant turn. The glue is found by
rendering the conversation with a sentinel in place of the assistant's text and
taking what the template writes after it, so any template works (ChatML for
SmolLM2 and Qwen, Llama 3's headers, ...).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from tree_rl.envs.base import Message

_SENTINEL = "\u2063SENTINEL\u2063"  # text no model writes


@dataclasses.dataclass(frozen=True)
class ChatFormat:
  """A tokenizer with a chat template (`transformers` PreTrainedTokenizer).

  Attributes:
    tokenizer: provides `apply_chat_template`, `encode`, `decode`.
    end_of_turn: the text that closes an assistant turn ("<|im_end|>" for ChatML);
      when a step's sampled text already ends with it, the glue omits it.
  """

  tokenizer: Any
  end_of_turn: str

  @classmethod
  def from_tokenizer(cls, tokenizer: Any) -> "ChatFormat":
    if getattr(tokenizer, "chat_template", None) is None:
      raise ValueError("the tokenizer has no chat_template; the agent loop needs one")
    probe = cls(tokenizer, "")
    after = probe._render([{"role": "user", "content": "u"},
                           {"role": "assistant", "content": _SENTINEL}], False)
    tail = after[after.index(_SENTINEL) + len(_SENTINEL):]
    eos = tokenizer.eos_token or ""
    end = eos if eos and tail.startswith(eos) else tail.strip()
    return cls(tokenizer, end)

  @property
  def eos_ids(self) -> tuple[int, ...]:
    """Token ids that end a step: the tokenizer's EOS and a one-token end of turn."""
    ids = {self.tokenizer.eos_token_id}
    end = self.encode(self.end_of_turn) if self.end_of_turn else []
    if len(end) == 1:
      ids.add(end[0])
    return tuple(sorted(i for i in ids if i is not None))

  @property
  def assistant_header(self) -> str:
    """The text the template writes to open an assistant turn ("<|im_start|>assistant\n")."""
    msgs = [{"role": "user", "content": "u"}]
    return self._render(msgs, True)[len(self._render(msgs, False)):]

  def _render(self, messages: Sequence[Message], generation_prompt: bool) -> str:
    return self.tokenizer.apply_chat_template(list(messages), tokenize=False,
                                              add_generation_prompt=generation_prompt)

  def encode(self, text: str) -> list[int]:
    return list(self.tokenizer.encode(text, add_special_tokens=False))

  def decode(self, tokens: Sequence[int]) -> str:
    return self.tokenizer.decode(list(tokens), skip_special_tokens=False)

  def content(self, step_text: str) -> str:
    """The assistant message content of a sampled step: without its end-of-turn marker."""
    end = self.end_of_turn
    return step_text[:-len(end)] if end and step_text.endswith(end) else step_text

  def prompt_tokens(self, messages: Sequence[Message]) -> list[int]:
    """The prompt up to and including the first assistant header."""
    return self.encode(self._render(messages, True))

  def glue_tokens(self, messages: Sequence[Message], step_text: str,
                  tool_messages: Sequence[Message]) -> list[int]:
    """Tokens between a sampled step and the next one.

    Args:
      messages: the conversation before the step.
      step_text: the decoded sampled step (only whether it ended the turn matters).
      tool_messages: the tool replies to append (may be empty).
    """
    convo = list(messages) + [{"role": "assistant", "content": _SENTINEL}] + list(tool_messages)
    text = self._render(convo, True)
    glue = text[text.index(_SENTINEL) + len(_SENTINEL):]
    if self.end_of_turn and step_text.endswith(self.end_of_turn) and glue.startswith(
        self.end_of_turn):
      glue = glue[len(self.end_of_turn):]
    return self.encode(glue)
