"""Masks the backward reads kept packed, eight to a byte, from their draw to their use.

A dropout mask the backward reads is one byte per element held from its draw to its use.
Kept as bits it is an eighth of that:
`pack_mask` after the draw, `unpack_mask` where the backward first needs it. Packing and
unpacking cost time in every step, and the backward's readers read the unpacked copy, so it
pays only under budgets that force recomputation: it makes a variant of the graph
(`pack_saved_masks` on a copy), planned beside the unpacked one.
"""

from __future__ import annotations

import torch
from torch import fx

from rkgraph.build import is_backward
from rkgraph.rewrites.fx_helpers import call, positions

# Words of eight mask bytes handled at a time: the temporaries are this many int64 (packing)
# or int32 (unpacking), not the whole mask's.
CHUNK_WORDS = 1 << 15
# Eight bytes 0/1 (little-endian in an int64) times this, shifted right by 56: byte i's bit
# lands at bit i, with no carries (each byte of the product sums distinct bits).
_GATHER_BITS = 0x0102040810204080
# Byte value -> the int64 whose byte i is its bit i: unpacking is a lookup.
_SPREAD_BITS = torch.tensor([sum(((b >> i) & 1) << (8 * i) for i in range(8)) for b in range(256)],
                            dtype=torch.int64)


def _words(mask: torch.Tensor) -> torch.Tensor:
    """`mask`'s bytes in memory order as int64 words (a view; see `_packable`)."""
    return mask.as_strided((mask.numel(),), (1,)).view(torch.int64)


def _packable(val: object) -> bool:
    """Whether `val` (a mask's fake value) can be packed by its memory: bool, dense from its
    storage's start (as `dropout_mask` makes it), a whole number of words."""
    return (
        isinstance(val, torch.Tensor) and val.dtype == torch.bool and val.numel() > 0
        and val.numel() % 8 == 0 and val.storage_offset() == 0
        and torch.empty_like(val).stride() == val.stride()  # kept only by a dense layout
    )


@torch.library.custom_op("rkgraph::pack_mask", mutates_args=())
def pack_mask(mask: torch.Tensor) -> torch.Tensor:
    """`mask`'s bytes in memory order, eight to a byte: element 8k + i of the memory is bit i of
    byte k."""
    words = _words(mask)
    packed = torch.empty(words.numel(), dtype=torch.uint8, device=mask.device)
    for start in range(0, words.numel(), CHUNK_WORDS):
        chunk = words[start:start + CHUNK_WORDS].mul(_GATHER_BITS)
        packed[start:start + CHUNK_WORDS] = chunk.bitwise_right_shift_(56).bitwise_and_(0xFF)
        del chunk  # else the next chunk is made while this one is alive
    return packed


@pack_mask.register_fake
def _(mask: torch.Tensor) -> torch.Tensor:
    return mask.new_empty(mask.numel() // 8, dtype=torch.uint8)


@torch.library.custom_op("rkgraph::unpack_mask", mutates_args=())
def unpack_mask(packed: torch.Tensor, size: list[int], stride: list[int]) -> torch.Tensor:
    """The bool mask of this size and stride that `pack_mask` packed."""
    mask = torch.empty_strided(size, stride, dtype=torch.bool, device=packed.device)
    words, spread = _words(mask), _SPREAD_BITS.to(packed.device)
    for start in range(0, words.numel(), CHUNK_WORDS):
        torch.index_select(spread, 0, packed[start:start + CHUNK_WORDS].int(), out=words[start:start + CHUNK_WORDS])
    return mask


@unpack_mask.register_fake
def _(packed: torch.Tensor, size: list[int], stride: list[int]) -> torch.Tensor:
    return torch.empty_strided(size, stride, dtype=torch.bool, device=packed.device)


def packing_scratch_bytes(node: fx.Node) -> int:
    """What `pack_mask` (a chunk of int64 words, and a word for each scalar operand ATen wraps
    in a tensor) or `unpack_mask` (a chunk of int32 indices) allocates and frees inside, for
    profiles that do not measure it."""
    if node.target is torch.ops.rkgraph.pack_mask.default:
        return (min(node.args[0].meta["val"].numel() // 8, CHUNK_WORDS) + 1) * 8
    return min(node.args[0].meta["val"].numel(), CHUNK_WORDS) * 4


def pack_saved_masks(gm: fx.GraphModule) -> int:
    """Keep every mask of `gm`'s joint graph that the backward reads packed: `pack_mask` after
    its draw, `unpack_mask` before its first reader in the backward, which then reads that
    (the caller recompiles). Returns how many masks."""
    graph, count = gm.graph, 0
    order = positions(graph)
    for mask in list(graph.find_nodes(op="call_function", target=torch.ops.rkgraph.dropout_mask.default)):
        readers = sorted((u for u in mask.users if is_backward(u)), key=order.__getitem__)
        if not readers or not _packable(mask.meta.get("val")):
            continue
        val = mask.meta["val"]
        with graph.inserting_after(mask):
            packed = call(graph, torch.ops.rkgraph.pack_mask.default, (mask,), {}, mask.meta)
        with graph.inserting_before(readers[0]):  # with the reader's tags (backward, module)
            unpacked = call(graph, torch.ops.rkgraph.unpack_mask.default,
                            (packed, list(val.shape), list(val.stride())), {}, readers[0].meta)
        for reader in readers:
            reader.replace_input_with(mask, unpacked)
        count += 1
    return count
