"""Split a streamed completion into reasoning and answer text.

Thinking models wrap their reasoning in markers (``<think>…</think>`` for Qwen3 and
DeepSeek, ``<|channel>thought…<channel|>`` for Gemma 4). The OpenAI-style API returns
the inside as ``reasoning_content`` and the rest as ``content``, while tokens stream in,
so markers may arrive split across tokens: text that could still be the start of a
marker is held back until it is decided.

Some templates open the block in the prompt itself (Qwen3.5 and DeepSeek-V4 with
thinking on end the prompt with ``<think>``): pass ``started_in_prompt=True`` — see
:func:`prompt_opens_reasoning` — and the completion begins inside the reasoning.
Whitespace that only frames the block (newlines after the opening marker, before the
closing one, and before the answer) is dropped, as the templates themselves do when
they render a past turn.

Some models may also leave their reasoning by opening a tool-call block without the closing
marker (DeepSeek-V4 writes ``<｜DSML｜tool_calls>`` straight after its thoughts; llama.cpp's
parser takes that too): such markers (``also_ends``) end the reasoning and begin the answer.
"""

from __future__ import annotations

import enum

from hf2q.text.markers import MarkerMatcher

GEMMA4_CHANNEL_LABEL = "thought"


class _State(enum.Enum):
    DECIDING = "deciding"  # nothing but whitespace so far: may still open a block
    REASONING = "reasoning"
    ANSWER_START = "answer_start"  # just closed a block: drop framing newlines
    ANSWER = "answer"


class ReasoningSplitter:
    """``feed(text) -> (reasoning_delta, content_delta)``; ``finish()`` flushes."""

    def __init__(self, start: str = "<think>", end: str = "</think>", *, started_in_prompt: bool = False,
                 also_ends: tuple[str, ...] = ()):
        self.start = start
        self.end = end
        self.label = GEMMA4_CHANNEL_LABEL if start == "<|channel>" else ""
        self._state = _State.REASONING if started_in_prompt else _State.DECIDING
        self._buf = ""
        self._end = MarkerMatcher([end, *also_ends])  # holds back a closing marker cut at a chunk end
        self._reasoning_started = False  # leading whitespace of the block already skipped
        self._held_newlines = ""
        self.saw_reasoning = started_in_prompt

    @property
    def in_reasoning(self) -> bool:
        return self._state is _State.REASONING

    def feed(self, text: str) -> tuple[str, str]:
        self._buf += text
        reasoning, content = [], []
        while True:
            progressed = self._step(reasoning, content)
            if not progressed:
                break
        return "".join(reasoning), "".join(content)

    def _step(self, reasoning: list[str], content: list[str]) -> bool:
        buf = self._buf
        if not buf:
            return False
        if self._state is _State.DECIDING:
            stripped = buf.lstrip()
            if stripped.startswith(self.start):
                self._buf = stripped[len(self.start) :]
                self._state = _State.REASONING
                self.saw_reasoning = True
                return True
            if not stripped or self.start.startswith(stripped):
                return False  # undecided: wait for more text
            self._state = _State.ANSWER
            return True
        if self._state is _State.REASONING:
            if not self._reasoning_started:
                if self.label:
                    if len(buf) < len(self.label) and self.label.startswith(buf):
                        return False
                    buf = buf.removeprefix(self.label)
                stripped = buf.lstrip("\n")
                self._buf = buf = stripped
                if not stripped:
                    return False
                self._reasoning_started = True
            ready, end, self._buf = self._end.scan(buf)
            if end is not None:
                if end != self.end:  # a marker of the answer's own: it stays there
                    self._buf = end + self._buf
                piece = self._held_newlines + ready
                self._held_newlines = ""
                reasoning.append(piece.rstrip("\n"))
                self._state = _State.ANSWER_START
                return True
            if ready:
                body = ready.rstrip("\n")
                trailing = ready[len(body) :]
                if body:
                    reasoning.append(self._held_newlines + body)
                    self._held_newlines = trailing
                else:
                    self._held_newlines += trailing
            return False
        if self._state is _State.ANSWER_START:
            stripped = buf.lstrip("\n")
            self._buf = stripped
            if not stripped:
                return False
            self._state = _State.ANSWER
            return True
        content.append(buf)
        self._buf = ""
        return False

    def finish(self) -> tuple[str, str]:
        """End of stream: whatever was held back, on the side it was heading to."""
        buf, self._buf = self._buf + self._end.scan("", final=True).text, ""
        if self._state is _State.REASONING:
            return (self._held_newlines + buf).rstrip("\n") if self._reasoning_started or buf.strip() else "", ""
        if self._state is _State.ANSWER_START:
            return "", buf.lstrip("\n")
        return "", buf


def prompt_opens_reasoning(prompt: str, start: str = "<think>", end: str = "</think>") -> bool:
    """True when the rendered prompt leaves a reasoning block open for the model to fill."""
    i = prompt.rfind(start)
    return i != -1 and prompt.find(end, i) == -1


def closing_text(prompt: str, prompt_without_thinking: str | None, end: str = "</think>") -> str:
    """What a reply must write first to close the reasoning block ``prompt`` leaves open, so
    that a constrained answer (a forced call, a JSON reply) lands outside it.

    The template's own closing is used where it has one: when its thinking-off rendering of the
    same conversation extends the thinking-on one (Qwen3.5: ``<think>\n`` → ``<think>\n\n
    </think>\n\n``), the difference is what an empty reasoning block looks like in that
    template, and what it writes for the turn in the history. Otherwise, the end marker alone.
    """
    if prompt_without_thinking and prompt_without_thinking.startswith(prompt) and end in (
            prompt_without_thinking[len(prompt):]):
        return prompt_without_thinking[len(prompt):]
    return end


def splitter_for(template, prompt: str, also_ends: tuple[str, ...] = ()) -> ReasoningSplitter | None:
    """The splitter for a :class:`~hf2q.text.chat_template.ChatTemplate`'s markers, or None."""
    markers = template.thinking_markers
    if markers is None:
        return None
    start, end = markers
    return ReasoningSplitter(start, end, started_in_prompt=prompt_opens_reasoning(prompt, start, end),
                             also_ends=also_ends)


def split_complete(text: str, start: str = "<think>", end: str = "</think>", *, started_in_prompt: bool = False) -> tuple[str, str]:
    """Non-streaming convenience: ``(reasoning, content)`` of a whole completion."""
    s = ReasoningSplitter(start, end, started_in_prompt=started_in_prompt)
    r1, c1 = s.feed(text)
    r2, c2 = s.finish()
    return r1 + r2, c1 + c2
