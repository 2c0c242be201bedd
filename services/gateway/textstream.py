"""Token ids → released text: incremental detokenization, stop strings with hold-back, reasoning split.

The verifier streams token ids; what a client may see is decided here. Two rules shape the code:

* A stop string can be split over several tokens (and several verifier chunks), so the last
  `len(longest stop) - 1` characters are held back until the next token shows whether they begin a stop
  string. Text that is released is never taken back, so a stop string never leaks, not even in part.
* Models that think emit `<think> ... </think>` as single added tokens. When both token strings exist in
  the vocabulary the text between them goes to the `reasoning` channel (OpenAI-compatible servers put it
  in `reasoning_content`), everything else to `content`. Templates that open the think block in the
  generation prompt (Qwen3 with enable_thinking) start the stream inside it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from services.engine.tokenizer import Tokenizer

CONTENT = "content"
REASONING = "reasoning"

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


@dataclass(frozen=True)
class Piece:
    """Text released to the client on one channel (`content` or `reasoning`)."""

    channel: str
    text: str


def think_token_ids(tok: Tokenizer) -> tuple[int, int] | None:
    """Ids of `<think>` and `</think>` when the vocabulary has both as single tokens, else None."""
    open_id, close_id = tok.token_to_id(THINK_OPEN), tok.token_to_id(THINK_CLOSE)
    if open_id is None or close_id is None:
        return None
    return open_id, close_id


def prompt_opens_thinking(prompt_text: str) -> bool:
    """True when the rendered prompt ends inside an open think block (the model continues reasoning)."""
    tail = prompt_text.rstrip()
    return tail.endswith(THINK_OPEN)


class TextAssembler:
    """Turns a stream of token ids into released text pieces for one request.

    `push(token_id)` returns the pieces that became final; `finish()` releases what is held back at the
    end of the stream. Once a stop string matched, `stopped` is True and further tokens are ignored; the
    caller should cancel the upstream call.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        stop: Sequence[str] = (),
        stop_ids: Iterable[int] = (),
        think_ids: tuple[int, int] | None = None,
        in_reasoning: bool = False,
    ):
        self._decoder = tokenizer.new_decoder()
        self._stop = [s for s in stop if s]
        # Hold back one character less than the longest stop string: a full match is caught at once.
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._stop_ids = frozenset(int(i) for i in stop_ids)
        self._think = think_ids
        self._channel = REASONING if (think_ids is not None and in_reasoning) else CONTENT
        self._pending = ""
        # Whitespace right after a think boundary is formatting ("<think>\n", "</think>\n\n"); clients of
        # llama.cpp and vLLM get the channels without it.
        self._lstrip = self._channel == REASONING
        self.stopped = False
        self.matched_stop: str | None = None
        self.tokens = 0                     # tokens consumed, up to and including the one that stopped

    @property
    def channel(self) -> str:
        return self._channel

    def push(self, token_id: int) -> list[Piece]:
        if self.stopped:
            return []
        self.tokens += 1
        token_id = int(token_id)
        if token_id in self._stop_ids:
            # EOS and friends end generation; their text ("<|im_end|>") is never part of the answer.
            return []
        if self._think is not None and token_id in self._think:
            out = self._release(final=True)
            self._channel = REASONING if token_id == self._think[0] else CONTENT
            self._lstrip = True
            return out
        self._pending += self._decoder.push(token_id)
        return self._release(final=False)

    def finish(self) -> list[Piece]:
        """End of stream: flush the decoder (an incomplete character becomes U+FFFD) and the hold-back."""
        if self.stopped:
            return []
        self._pending += self._decoder.flush()
        return self._release(final=True)

    def _release(self, final: bool) -> list[Piece]:
        text = self._pending
        cut = self._find_stop(text)
        if cut is not None:
            self.stopped = True
            out, self._pending = text[:cut], ""
        elif final:
            out, self._pending = text, ""
        else:
            keep = min(self._hold, len(text))
            out, self._pending = text[: len(text) - keep], text[len(text) - keep:]
        if self._lstrip and out:
            out = out.lstrip()
            if out:
                self._lstrip = False
        return [Piece(self._channel, out)] if out else []

    def _find_stop(self, text: str) -> int | None:
        best: int | None = None
        for s in self._stop:
            i = text.find(s)
            if i >= 0 and (best is None or i < best):
                best, self.matched_stop = i, s
        return best
