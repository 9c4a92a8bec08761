"""Drawing graphs: files in each format, clusters per block, the collapsed view of big graphs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import rkgraph
from rkgraph.blocks import block_module
from rkgraph.graph import RematGraph
from rkgraph.render import graph_dot
from rockplan import zoo


def small_graph() -> RematGraph:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.GELU()) for _ in range(3)]
    model = nn.Sequential(*blocks, nn.Linear(16, 4))
    return rkgraph.capture(model, torch.randn(64, 16))


@pytest.fixture(scope="module")
def graph() -> RematGraph:
    return small_graph()


@pytest.mark.parametrize("suffix", [".pdf", ".png", ".svg"])
def test_render_writes_the_format_of_the_suffix(graph: RematGraph, tmp_path: Path, suffix: str) -> None:
    path = graph.render(tmp_path / f"graph{suffix}")
    magic = {".pdf": b"%PDF", ".png": b"\x89PNG", ".svg": b"<?xml"}[suffix]
    assert path.read_bytes().startswith(magic)
    assert list(tmp_path.iterdir()) == [path]  # no DOT source left behind


def test_full_view_has_a_cluster_per_block_and_sized_edges(graph: RematGraph) -> None:
    source = graph_dot(graph, collapse=False).source
    for i, block in enumerate(graph.blocks):
        assert f"cluster_block_{i}" in source
        assert f"block {i} · class {graph.block_classes[i]}" in source
        module = block_module(graph, block)
        assert f"class {graph.block_classes[i]}\n{module}" in source
    assert "cluster_backward" in source
    assert "4.0 KiB" in source  # a 64x16 float activation, large enough to be labelled
    assert all(f'"{n.name}"' in source or f"{n.name} " in source for n in graph.nodes)


def test_decisions_colour_nodes_and_fill_the_legend(graph: RematGraph) -> None:
    first, second = graph.forward_nodes[0].name, graph.forward_nodes[1].name
    source = graph_dot(graph, {first: "recomputed", second: "kept"}, collapse=False).source
    assert "#f4a261" in source and "#a6dba0" in source and "cluster_legend" in source
    assert "freed early" not in source  # the legend lists only decisions that occur
    with pytest.raises(ValueError, match="decision"):
        graph_dot(graph, {first: "dropped"})
    with pytest.raises(ValueError, match="no compute or data node"):
        graph_dot(graph, {"nonexistent": "kept"})


def test_render_rejects_unknown_suffix(graph: RematGraph, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="suffix"):
        graph.render(tmp_path / "graph.jpeg")


def test_collapsed_gpt_has_one_node_per_block() -> None:
    model, args, kwargs, _ = zoo.make("gpt", "tiny")
    graph = rkgraph.capture(model, args, kwargs)
    dot = graph_dot(graph, collapse=True)
    block_nodes = [line for line in dot.body if line.lstrip().startswith("block_") and "->" not in line]
    assert len(block_nodes) == len(graph.blocks)
    assert f"{len(graph.blocks) - 1} · class" in dot.source and "backward of block" in dot.source
    assert not any(f'\t"{n.name}"' in dot.source or f"\t{n.name} [" in dot.source for n in graph.nodes)
