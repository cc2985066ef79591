"""The packing planner of the padding-free trainer (packed.py): which tokens go where in a packed chunk.

Pure Python and numpy (no torch): `plan` turns a batch of datums into chunks (`Layout`) of at most a token
budget, sharing the runs of tokens that datums have in common as prefix trees; packed.py turns a Layout into
attention work. tests/test_packed.py checks the plans and what the forward computes from them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from backends.types import Datum

# Datums that share a prompt (an RL group: group_size samples of one prompt; the turns of one multi-turn
# episode; chats with one system prompt) are packed as a tree: each shared run of tokens once, then what
# continues it, nested as deep as the sharing goes (a system prompt shared by a whole batch, then a first user
# turn shared by some of those chats, ...). Every row attends causally to its own run and to all of its
# ancestors' rows, at the position it has in its own sequence. A shared run's hidden states are the same for
# every datum through it, so computing them once changes no number beyond float rounding, and its gradient is
# the sum of theirs (tests/test_packed.py). rl_basic (8 samples of a 69-token prompt with 2-8 answer tokens)
# trains on ~900 tokens a step instead of ~4,600; bench_train's chat batches (16 chats, 14 with one system
# prompt, some also with one first turn) on 2157 of 2551 tokens (2105 on the 25M model). A run is shared when
# at least PackedLM.min_shared() tokens long (MIN_SHARED on small models, fewer on wide ones).
MIN_SHARED = 16


@dataclass
class _Node:
    """Tokens [offset, offset + length) of every datum in `members` (they agree on them and on everything
    before), then the subtrees that continue them. A lone sequence is one node with one member."""

    offset: int
    length: int
    members: list[int]  # datum indices, in sorted order
    children: list[_Node]

    def size(self) -> int:
        return self.length + sum(c.size() for c in self.children)


@dataclass
class Layout:
    """One packed chunk: its tokens and rotary positions, each datum's rows (its ancestors' runs, then its own),
    and the attention blocks (runs of lone sequences of equal length; trees)."""

    datums: list[int]
    tokens: list[int]
    positions: list[int]
    rows: dict[int, np.ndarray]
    runs: list[tuple[int, int, int]]  # (first row, sequences, length) of lone sequences
    trees: list[list[tuple[int, int, int]]]  # per tree, its nodes in row order: (first row, length, parent or -1)

    def segments(self) -> tuple[list[tuple[int, int, int, int]], list[tuple[int, int]], list[int]]:
        """The chunk's attention segments, each lone sequence and each tree node with rows, in row order:
        seg = (first row, rows, first and end index into anc); anc = an ancestor segment's (first row, rows),
        root first; keys = per segment, the rows its queries see (its ancestors' and its own)."""
        seg: list[tuple[int, int, int, int]] = []
        anc: list[tuple[int, int]] = []
        for start, c, n in self.runs:
            seg.extend((start + i * n, n, len(anc), len(anc)) for i in range(c))
        for nodes in self.trees:
            for (first, length, _), chain in zip(nodes, ancestors(nodes)):
                if length:
                    a0 = len(anc)
                    anc.extend((nodes[a][0], nodes[a][1]) for a in chain if nodes[a][1])
                    seg.append((first, length, a0, len(anc)))
        seg.sort()
        assert sum(n for _, n, _, _ in seg) == len(self.tokens), "segments must cover every row"
        keys = [n + sum(length for _, length in anc[a0:a1]) for _, n, a0, a1 in seg]
        return seg, anc, keys


def ancestors(nodes: list[tuple[int, int, int]]) -> list[list[int]]:
    """Per node of a tree (first row, length, parent or -1; parents first), its ancestors' indices, root first."""
    chains: list[list[int]] = []
    for _, _, parent in nodes:
        chains.append([] if parent < 0 else [*chains[parent], parent])
    return chains


def plan(data: list[Datum], budget: int, min_shared: int | None = None) -> list[Layout]:
    """The datums as packed chunks: shared runs of at least `min_shared` tokens (default MIN_SHARED) found,
    trees and lone sequences packed longest first into chunks of at most `budget` tokens."""
    order = sorted(range(len(data)), key=lambda i: data[i].model_input)
    roots = _grow(data, order, 0, MIN_SHARED if min_shared is None else min_shared)
    chunks = plan_packs([root.size() for root in roots], budget)
    return [_layout(data, [roots[j] for j in chunk]) for chunk in chunks]


def _grow(data: list[Datum], members: list[int], offset: int, min_shared: int) -> list[_Node]:
    """The nodes for `members` (sorted; they agree on their first `offset` tokens): neighbours that agree on at
    least MIN_SHARED more tokens share a node for those, with the rest below it."""
    groups: list[tuple[list[int], int]] = []  # (members, tokens from offset all of them agree on)
    for i in members:
        if groups:
            group, common = groups[-1]
            head = data[group[0]].model_input
            more = _common_prefix(head, data[i].model_input, offset + common) - offset
            if more >= min_shared:
                group.append(i)
                groups[-1] = (group, more)
                continue
        groups.append(([i], data[i].length - offset))
    nodes = []
    for group, common in groups:
        children = _grow(data, group, offset + common, min_shared) if len(group) > 1 else []
        nodes.append(_Node(offset, common, group, children))
    return nodes


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    n = min(len(a), len(b), limit)
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _layout(data: list[Datum], roots: list[_Node]) -> Layout:
    lone = sorted((r for r in roots if not r.children), key=lambda r: -r.length)
    trees = [r for r in roots if r.children]
    tokens: list[int] = []
    positions: list[int] = []
    rows: dict[int, np.ndarray] = {}
    runs: list[tuple[int, int, int]] = []
    tree_nodes: list[list[tuple[int, int, int]]] = []
    order: list[int] = []
    for node in lone:  # a root without children has one member
        n, start = node.length, len(tokens)
        tokens += data[node.members[0]].model_input
        positions += range(n)
        for i in node.members:
            rows[i] = np.arange(start, start + n)
            order.append(i)
        if runs and runs[-1][2] == n:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1, n)
        else:
            runs.append((start, 1, n))

    # Pre-order (a node, then each child's subtree): a node's descendants are the rows right after it, which
    # attention.py's FlexAttention mask relies on (tests/test_attention.py).
    def place(node: _Node, parent: int, path: np.ndarray, out: list[tuple[int, int, int]]) -> None:
        start = len(tokens)
        tokens.extend(data[node.members[0]].model_input[node.offset:node.offset + node.length])
        positions.extend(range(node.offset, node.offset + node.length))
        out.append((start, node.length, parent))
        here = len(out) - 1
        path = np.concatenate([path, np.arange(start, start + node.length)])
        below = {m for c in node.children for m in c.members}
        for m in node.members:
            if m not in below:  # the datum ends here
                rows[m] = path
                order.append(m)
        for child in node.children:
            place(child, here, path, out)

    for root in trees:
        nodes: list[tuple[int, int, int]] = []
        place(root, -1, np.zeros(0, dtype=np.int64), nodes)
        tree_nodes.append(nodes)
    return Layout(order, tokens, positions, rows, runs, tree_nodes)




def plan_packs(lengths: list[int], budget: int) -> list[list[int]]:
    """Indices grouped into packed chunks of at most `budget` tokens in all (a longer row alone), filled
    greedily longest first (plan packs its trees and lone sequences with it)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    chunks: list[list[int]] = []
    total = 0
    for i in order:
        if chunks and total + lengths[i] <= budget:
            chunks[-1].append(i)
            total += lengths[i]
        else:
            chunks.append([i])
            total = lengths[i]
    return chunks
