"""Scripted output, for tests only: ``FREETOKEN_TEST_SCRIPT=<file>`` forces the tokens the worker samples.

End-to-end tests of tool calls and reasoning need a model that writes ``<tool_call>`` / ``<think>`` on cue; a tiny
random checkpoint never does. With this hook the real server path runs (chat template, tokenizer, scheduler,
worker step, detokenizer, stop tokens, the reasoning and tool-call parsers); only the sampled token ids are
replaced.

The file holds JSON: a list of turns, each a list of token ids. A page-table row that samples while it has no turn
takes the next unused one; while it has one, its sampled token is replaced by the turn's next token, and the turn
is over after its last token (end it with an end-of-turn token so the request ends with it). A row finding no
unused turn samples as usual (as does a row whose request already generated tokens: under overlap scheduling a
request ending with its turn runs one step more, which must not take the next request's turn). The file is read
again whenever a row needs a turn, so a test appends a turn before each request (write it atomically: a temporary
file, then ``os.replace``). Start the server with an empty list: the start-up dry run samples too, and would take a
turn. A request that ends before its turn does (a stop string, a disconnect) leaves the rest of the turn to the next
request on its row.

Only the eager sampling path (``Worker._sample``) is scripted: run the server with ``--disable-cuda-graph``.
Without the variable, ``force`` returns the tokens untouched after one ``None`` check.
"""

from __future__ import annotations

import json
import os
from typing import Optional

import torch


class ScriptedOutput:
    def __init__(self, path: str):
        self.path = path
        self.used = 0  # turns taken so far
        self.active: dict[int, list[int]] = {}  # page-table row -> what is left of its turn

    def _next_turn(self) -> Optional[list[int]]:
        try:
            with open(self.path, encoding="utf-8") as f:
                turns = json.load(f)
        except (OSError, ValueError):
            return None
        if self.used >= len(turns):
            return None
        self.used += 1
        return [int(t) for t in turns[self.used - 1]]

    def force(self, tokens: torch.Tensor, rows: torch.Tensor, counts=None) -> torch.Tensor:
        forced = None
        for i, row in enumerate(rows.tolist()):
            turn = self.active.get(row)
            if turn is None and counts is not None and bool(counts.counts[row].any()):
                continue  # not the request's first token: a step past its end (overlap) takes no turn
            if turn is None:
                turn = self._next_turn()
                if not turn:
                    continue
                self.active[row] = turn
            if forced is None:
                forced = tokens.clone()
            forced[i] = turn.pop(0)
            if not turn:
                del self.active[row]
        return tokens if forced is None else forced


_SCRIPT = ScriptedOutput(os.environ["FREETOKEN_TEST_SCRIPT"]) if os.environ.get("FREETOKEN_TEST_SCRIPT") else None


def force(tokens: torch.Tensor, rows: torch.Tensor, counts=None) -> torch.Tensor:
    """``tokens`` sampled for page-table ``rows``, with scripted ones put in (tests only; see the module doc). With
    ``counts`` (``OutputTokenCounts``) a row takes a new turn only for its request's first token."""
    return tokens if _SCRIPT is None else _SCRIPT.force(tokens, rows, counts)
