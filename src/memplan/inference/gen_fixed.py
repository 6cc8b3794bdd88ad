"""`generate()` on fake tensors: the answers to its data-dependent questions under the fixed-shape rule.

transformers' `generate()` (generation/utils.py at 5.23) asks its tensors a few questions
whose answers are data: whether a prompt is right-padded, whether the attention mask is all
ones, whether every sequence has finished. A fake tensor has no data, so each such question
(`aten._local_scalar_dense`, what `.item()`, `bool()` and a tensor index run) is answered here
by the rule memplan traces under, which is what a real call does with `min_new_tokens =
max_new_tokens = N`:

- the special tokens are valid (the two checks of `_prepare_special_tokens` only choose
  whether a warning is logged);
- the B prompts are L valid token ids each (none negative), with no padding: `has_right_padding` is False and the
  mask is all ones (so `generate` drops it, as it does for a real unpadded batch);
- no sequence finishes before N new tokens (the minimum-length processor masks the
  end-of-sequence token until then) and every one stops at N (the maximum-length criterion):
  the loop of `_sample` stops when the sequence length reaches `max_length`, and beam search
  (`_beam_search`) runs exactly N steps and returns N new tokens; its beams are reordered in a
  cache that holds the prompt already (a static layer's length is a tensor).

Each question is recognised by where it is asked: the transformers function and the text of
the line (`SITES`). A question from anywhere else is refused (`UserError`, with the file and
line), so no data-dependent branch is ever answered by a guess.
"""

from __future__ import annotations

import ast
import functools
import linecache
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.utils._python_dispatch import TorchDispatchMode

from memplan.errors import UserError

_LOCAL_SCALAR = torch.ops.aten._local_scalar_dense.default


@dataclass(frozen=True)
class Site:
    """A data-dependent question of transformers' generation code: the function that asks it,
    a piece of the line's text, and the rule's answer (from that frame's locals and the
    call's `max_length`)."""

    function: str
    text: str
    answer: Callable[[dict[str, Any], int], Any]


SITES = (
    # two checks of the special tokens that decide only whether a warning is logged
    Site("_prepare_special_tokens", "torch.isin(eos_token_tensor, pad_token_tensor).any()", lambda f, m: False),
    Site("_prepare_special_tokens", "(eos_token_tensor < 0).any()", lambda f, m: False),
    Site("_get_logits_processor", "not (encoder_input_ids < 0).any()", lambda f, m: False),
    Site("generate", "has_right_padding = torch.any(", lambda f, m: False),
    Site("generate", '(model_kwargs["attention_mask"] == 1).all()', lambda f, m: True),
    Site("__call__", "unfinished_sequences.max() == 0", lambda f, m: f["length"] >= m),
    # a static cache's length is a tensor; beams are reordered once it holds the prompt
    Site("reorder_cache", "if self.get_seq_length() > 0:", lambda f, m: True),
    # the value beam search fills its output with (a token id: no size depends on it)
    Site("_beam_search", "output_fill_value = pad_token_id or eos_token_id[0]", lambda f, m: True),
    Site("_beam_search", "running_sequences = torch.full(", lambda f, m: 0),
    Site("_beam_search", "not self._beam_search_has_unfinished_sequences(", lambda f, m: f["cur_len"] < m),
    Site("_beam_search", "sequences[:, :output_length]", lambda f, m: f["cur_len"]),
    Site("_beam_search", "beam_indices[:, :max_generated_length]", lambda f, m: f["cur_len"] - f["decoder_prompt_len"]),
)


def _transformers_frame(frame: FrameType | None) -> FrameType | None:
    """The innermost frame of transformers' own code on the stack from `frame`."""
    while frame is not None:
        name = frame.f_code.co_filename.replace("\\", "/")
        if "/transformers/" in name:
            return frame
        frame = frame.f_back
    return None


@functools.cache
def _statements(filename: str) -> list[tuple[int, int]]:
    """(first line, last line) of every simple statement and every `if`/`while` test in a file."""
    tree = ast.parse("".join(linecache.getlines(filename)))
    spans = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.If, ast.While)):
            spans.append((node.lineno, node.test.end_lineno or node.lineno))
        elif isinstance(node, ast.stmt) and not isinstance(node, (ast.If, ast.While, ast.For, ast.With, ast.Try,
                                                                  ast.FunctionDef, ast.ClassDef)):
            spans.append((node.lineno, node.end_lineno or node.lineno))
    return spans


def _statement_text(frame: FrameType) -> str:
    """The source text of the innermost statement (or `if`/`while` test) `frame` is running."""
    filename, line = frame.f_code.co_filename, frame.f_lineno
    spans = [s for s in _statements(filename) if s[0] <= line <= s[1]]
    first, last = min(spans, key=lambda s: s[1] - s[0]) if spans else (line, line)
    return "".join(linecache.getline(filename, n) for n in range(first, last + 1))


class FixedShapeAnswers(TorchDispatchMode):
    """A dispatch mode that answers `generate()`'s data-dependent questions on fake tensors
    (module docstring) for a call that stops at `max_length` tokens; everything else passes."""

    def __init__(self, max_length: int) -> None:
        super().__init__()
        self.max_length = max_length
        self.answered: dict[str, int] = {}  # site text -> how many times it was answered

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is _LOCAL_SCALAR and is_fake(args[0]):
            return self.answer()
        return func(*args, **(kwargs or {}))

    def answer(self) -> Any:
        frame = _transformers_frame(sys._getframe(1))
        if frame is None:
            raise UserError("generate() on fake tensors read a tensor's value outside transformers' code: "
                            "memplan cannot trace this call")
        line = _statement_text(frame)
        for site in SITES:
            if frame.f_code.co_name == site.function and site.text in line:
                self.answered[site.text] = self.answered.get(site.text, 0) + 1
                return site.answer(frame.f_locals, self.max_length)
        where = f"{frame.f_code.co_filename.rpartition('/transformers/')[2]}:{frame.f_lineno}"
        raise UserError(f"generate() reads a tensor's value at transformers/{where} ({' '.join(line.split())}), a "
                        "data-dependent branch memplan's fixed-shape rule does not answer: this model or option "
                        "is not traced by this version of memplan")
