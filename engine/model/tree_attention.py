"""How a verify of draft trees (engine/round/tree.py) attends: a node sees the committed prefix
and its own ancestors, at the position of its depth. The runner's forwards, eager and compiled,
take the mask this builds in place of the causal one."""

from __future__ import annotations

from typing import NamedTuple

import torch


class Tree(NamedTuple):
    """A verify of draft trees (engine/round/tree.py): row b's query j is fed at position
    ``start_b + depth[b, j]`` and written to column ``start_b + j``, and sees the committed
    prefix and the queries ``visible[b, j]`` of its own row (its ancestors and itself)."""

    depth: torch.Tensor  # [batch, q] long on the device: 0 for the root (query 0)
    visible: torch.Tensor  # [batch, q, q] bool on the device; padding queries see themselves


def tree_mask(visible: torch.Tensor, starts: torch.Tensor, kv_len: int) -> torch.Tensor:
    """``[batch, 1, q, kv_len]`` bool: query j of row b sees key column c when c is in the
    committed prefix (c < start_b) or holds a query of the row that j sees (``visible``
    ``[batch, q, q]``, a :class:`Tree`'s; a chain's is lower-triangular, as a captured graph
    records it)."""
    q = visible.shape[1]
    rel = torch.arange(kv_len, device=starts.device)[None, :] - starts[:, None]  # [batch, kv_len]
    in_tree = (rel >= 0) & (rel < q)
    cols = rel.clamp(0, q - 1)[:, None, :].expand(-1, q, -1)  # [batch, q, kv_len]
    sees = visible.gather(2, cols) & in_tree[:, None, :]
    return (sees | (rel < 0)[:, None, :]).unsqueeze(1)


def tree_inputs(tree: Tree, starts: torch.Tensor, kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The positions ``[batch, q]`` (``start + depth``) and the mask (:func:`tree_mask`) of a
    tree verify whose rows start at ``starts`` ``[batch]``."""
    return starts[:, None] + tree.depth, tree_mask(tree.visible, starts, kv_len)
