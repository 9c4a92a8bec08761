"""Split dropout into its random mask and the mask's cheap application.

`native_dropout(x, p)` returns its output and the bool mask the backward reads. Recomputing
the output means drawing the mask again (replaying the RNG state): on CPU that draw is about
90% of the op's time. Split into `mask = dropout_mask(shape, stride, p)` and
`out = apply_dropout_mask(x, mask, 1 / (1 - p))`, the output can be dropped and remade from
`x` and the mask, which the backward keeps anyway (softmax's backward keeps `x` in
attention), for a pointwise multiply. The mask is a quarter of the output's bytes (bool
against float32).

The split must draw what eager draws. On CPU, `native_dropout` fills a contiguous bool
tensor with `bernoulli_(1 - p)` from the default generator, and so does `dropout_mask`:
the same mask, the generator left in the same state (tested against eager, bit for bit).
CUDA's fused dropout kernel draws its mask in a pattern no separate op reproduces, so CUDA
graphs are left as they are, and so are float16 and bfloat16 ones (see `_splittable`).

The application is also the backward's op (`native_dropout_backward(grad, mask, scale)`, the
same product), and on CPU ATen's kernel makes it as `grad * (mask * scale)`: a float copy of
the mask as large as its output, alive beside it. At GPT's attention dropout that is 6 MiB at
the moments a plan at 0.35 peaks. `apply_dropout_mask` multiplies a slice at a time into the
output and scales it in place: the same bits (the mask's product is exact, the scaling rounds
once either way), one slice of scratch, and on CPU a little faster than ATen's kernel. Every
CPU float32/float64 `native_dropout_backward` of the graph is replaced by it.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from rkgraph.build import is_backward
from rkgraph.rewrite import call, positions

aten = torch.ops.aten


@torch.library.custom_op("rkgraph::dropout_mask", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,))
def dropout_mask(size: list[int], stride: list[int], p: float, device: torch.device) -> torch.Tensor:
    """The mask (True: kept) `native_dropout(x, p)` draws on CPU, for an `x` whose mask has
    this size and stride (it keeps `x`'s layout, and the draws fill memory in order)."""
    return torch.empty_strided(size, stride, dtype=torch.bool, device=device).bernoulli_(1.0 - p)


@dropout_mask.register_fake
def _(size: list[int], stride: list[int], p: float, device: torch.device) -> torch.Tensor:
    return torch.empty_strided(size, stride, dtype=torch.bool, device=device)


# Elements multiplied at a time: the float copy of the mask ATen makes for a mixed-dtype
# product is this slice's, not the whole tensor's (256 KiB of float32).
SLICE_ELEMENTS = 1 << 16


def _multiply_by_slices(x: torch.Tensor, mask: torch.Tensor, out: torch.Tensor) -> None:
    if x.numel() <= SLICE_ELEMENTS or x.dim() == 0:
        torch.mul(x, mask, out=out)
        return
    per_row = x.numel() // x.shape[0]
    if per_row > SLICE_ELEMENTS:  # one index of the first dimension is still too large
        for i in range(x.shape[0]):
            _multiply_by_slices(x[i], mask[i], out[i])
        return
    rows = SLICE_ELEMENTS // per_row
    for i in range(0, x.shape[0], rows):
        torch.mul(x[i:i + rows], mask[i:i + rows], out=out[i:i + rows])


@torch.library.custom_op("rkgraph::apply_dropout_mask", mutates_args=(), tags=(torch.Tag.pointwise,))
def apply_dropout_mask(x: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """`native_dropout_backward(x, mask, scale)`, bit for bit, without its mask-sized scratch."""
    return apply_dropout_mask_into(x, mask, scale, torch.empty_like(x))


def apply_dropout_mask_into(x: torch.Tensor, mask: torch.Tensor, scale: float, out: torch.Tensor) -> torch.Tensor:
    """`apply_dropout_mask` written into `out` (`x` itself or a tensor laid out as `x`)."""
    if x.numel():
        _multiply_by_slices(x, mask, out)
    return out.mul_(scale)


@apply_dropout_mask.register_fake
def _(x: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.empty_like(x)


def scratch_bytes(node: fx.Node) -> int:
    """What an `apply_dropout_mask` node allocates and frees inside: one slice of the mask as
    floats, for profiles that do not measure it."""
    x = node.args[0].meta["val"]
    return min(x.numel(), SLICE_ELEMENTS) * x.element_size()


def _applicable(x: object, val: object) -> bool:
    """Whether `apply_dropout_mask(x, ...)` makes what ATen's application makes, `val`: the same
    bits on CPU in float32 and float64, and the same strides (its output is laid out as `x`)."""
    return (
        isinstance(val, torch.Tensor) and isinstance(x, torch.Tensor)
        and val.device.type == "cpu" and val.dtype in (torch.float32, torch.float64)
        and torch.empty_like(x).stride() == val.stride()
    )


def _val(arg: object) -> object:
    return arg.meta.get("val") if isinstance(arg, fx.Node) else None


def _splittable(node: fx.Node) -> bool:
    """Whether a `native_dropout` node can be split drawing and computing exactly what it does."""
    _, p, train = (*node.args, *([None] * 3))[:3]
    train = node.kwargs.get("train", train)
    val = node.meta.get("val")
    # Reduced precision rounds `x * mask * scale` twice in `native_dropout`, once in the
    # one-op application: equal bits for float32 and float64 only.
    return (
        train is not False and isinstance(p, float) and 0.0 < p < 1.0
        and isinstance(val, (tuple, list)) and _applicable(_val(node.args[0]), val[0])
        and all(u.target is operator.getitem for u in node.users)
    )


def split_dropout(gm: fx.GraphModule) -> int:
    """Rewrite every CPU `native_dropout` of `gm`'s graph, and every application of a mask
    (see the module docstring; the caller recompiles); returns how many nodes were replaced.
    The new nodes take the replaced node's metadata (forward or backward, module)."""
    count = 0
    for node in list(gm.graph.find_nodes(op="call_function", target=aten.native_dropout_backward.default)):
        if _applicable(_val(node.args[0]), node.meta.get("val")) and not node.kwargs:
            with gm.graph.inserting_before(node):
                applied = gm.graph.call_function(torch.ops.rkgraph.apply_dropout_mask.default, node.args)
            applied.meta = dict(node.meta)
            node.replace_all_uses_with(applied)
            gm.graph.erase_node(node)
            count += 1
    for node in list(gm.graph.find_nodes(op="call_function", target=aten.native_dropout.default)):
        if not _splittable(node):
            continue
        x, p = node.args[0], node.args[1]
        out_val, mask_val = node.meta["val"]
        with gm.graph.inserting_before(node):
            shape = (list(mask_val.shape), list(mask_val.stride()))
            mask = gm.graph.call_function(torch.ops.rkgraph.dropout_mask.default, (*shape, p, mask_val.device))
            mask.meta = {**node.meta, "val": mask_val}
            out = gm.graph.call_function(torch.ops.rkgraph.apply_dropout_mask.default, (x, mask, 1.0 / (1.0 - p)))
            out.meta = {**node.meta, "val": out_val}
        for item in list(node.users):
            item.replace_all_uses_with(out if item.args[1] == 0 else mask)
            gm.graph.erase_node(item)
        gm.graph.erase_node(node)
        count += 1
    return count


# --- masks kept packed for the backward ----------------------------------------------------
#
# A mask the backward reads is one byte per element held from its draw to its use. Kept as
# bits it is an eighth of that (GPT's attention dropout: 1.5 MiB -> 192 KiB a layer), made
# in the forward and unpacked where the backward needs it (for an attention mask 0.1 and
# 0.13 ms warm, about 0.3 ms each in a step, after the draw's serial kernel). A variant of
# the graph (`pack_saved_masks`), for budgets that force recomputation: the backward's readers
# read the unpacked copy, so in the variant every such mask is packed and unpacked.

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
