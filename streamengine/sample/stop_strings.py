"""Aho-Corasick matching of one request's stop strings, one character at a time.

The automaton is built once per stop list, in time linear in its total length, and is only
read afterwards, so the n detokenizers of a request share it; each keeps just its state, a node
number. A node stands for a string that is a prefix of some stop string; after reading text the
state is the node of the longest suffix of that text which is such a prefix. Reading a character
costs O(1) amortized whatever the number and length of the stop strings: each failure link taken
shortens that suffix, and a character lengthens it by at most one.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

ROOT = 0
"""The state before any text: the empty suffix."""


@dataclass(frozen=True, slots=True)
class StopAutomaton:
    """The trie of the stop strings with failure links; per-node tables are indexed by node."""

    stops: tuple[str, ...]
    children: tuple[dict[str, int], ...]
    fail: tuple[int, ...]  # node of the longest proper suffix that is a trie node
    match_len: tuple[int, ...]  # longest stop string that ends the node's string, 0 if none
    match_index: tuple[int, ...]  # its first position in `stops`; -1 if none
    held: tuple[int, ...]  # longest suffix that is a proper prefix of a stop string

    @property
    def num_nodes(self) -> int:
        return len(self.children)


@dataclass(frozen=True, slots=True, order=True)
class StopMatch:
    """A stop string found by `scan`; matches order by where they start, then by list position."""

    start: int  # offset of its first character from the start of the scanned text (< 0: before it)
    index: int  # position of the stop string in the automaton's `stops`


def build_automaton(stops: Sequence[str]) -> StopAutomaton:
    """The automaton of `stops` (non-empty strings; a repeated one counts at its first position)."""
    children: list[dict[str, int]] = [{}]
    depth = [0]
    terminal = [-1]
    for index, stop in enumerate(stops):
        node = _insert(children, depth, terminal, stop)
        if terminal[node] < 0:
            terminal[node] = index
    fail, match_len, match_index, held = _link(children, depth, terminal)
    return StopAutomaton(
        tuple(stops),
        tuple(children),
        tuple(fail),
        tuple(match_len),
        tuple(match_index),
        tuple(held),
    )


def _insert(
    children: list[dict[str, int]], depth: list[int], terminal: list[int], stop: str
) -> int:
    node = ROOT
    for ch in stop:
        nxt = children[node].get(ch)
        if nxt is None:
            nxt = len(children)
            children.append({})
            depth.append(depth[node] + 1)
            terminal.append(-1)
            children[node][ch] = nxt
        node = nxt
    return node


def _link(
    children: list[dict[str, int]], depth: list[int], terminal: list[int]
) -> tuple[list[int], list[int], list[int], list[int]]:
    """Failure links and the per-node answers, in breadth-first order: a node's failure link is
    shallower than the node, so its answers are known when the node's are derived from them."""
    size = len(children)
    fail, match_len, match_index, held = [ROOT] * size, [0] * size, [-1] * size, [0] * size
    queue = deque(children[ROOT].values())  # at depth 1: failure link ROOT, as initialised
    while queue:
        node = queue.popleft()
        link = fail[node]
        if terminal[node] >= 0:
            match_len[node], match_index[node] = depth[node], terminal[node]
        else:
            match_len[node], match_index[node] = match_len[link], match_index[link]
        # With children the node's string is itself a proper prefix of a stop string.
        held[node] = depth[node] if children[node] else held[link]
        for ch, child in children[node].items():
            fail[child] = _goto(children, fail, link, ch)
            queue.append(child)
    return fail, match_len, match_index, held


def _goto(children: Sequence[dict[str, int]], fail: Sequence[int], node: int, ch: str) -> int:
    """The state after reading `ch` in state `node`."""
    while True:
        nxt = children[node].get(ch)
        if nxt is not None:
            return nxt
        if node == ROOT:
            return ROOT
        node = fail[node]


def step(automaton: StopAutomaton, node: int, ch: str) -> int:
    """The state after reading one character."""
    return _goto(automaton.children, automaton.fail, node, ch)


def scan(automaton: StopAutomaton, node: int, text: str) -> tuple[int, StopMatch | None]:
    """Read `text` from state `node`: the state after it, and among the stop strings that end
    inside `text` the one that starts first (the earlier listed on a tie), or None.

    The longest stop string ending at a position starts first of those ending there, so one
    candidate per position is enough.
    """
    children, fail = automaton.children, automaton.fail
    match_len, match_index = automaton.match_len, automaton.match_index
    best: StopMatch | None = None
    for offset, ch in enumerate(text):
        node = _goto(children, fail, node, ch)
        length = match_len[node]
        if length:
            found = StopMatch(offset + 1 - length, match_index[node])
            if best is None or found < best:
                best = found
    return node, best


def held_length(automaton: StopAutomaton, node: int) -> int:
    """Characters at the end of the text read so far that could still begin a stop string."""
    return automaton.held[node]
