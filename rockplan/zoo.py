"""Small models with realistic structure, for tests, examples and benchmarks.

Every entry is a factory ``factory(size="tiny", **options) -> ZooEntry``; a ``ZooEntry`` unpacks
as ``model, args, kwargs, loss_fn`` where ``loss_fn(model(*args, **kwargs), *args)`` is a scalar.
Targets the loss needs (class labels, segmentation masks) are drawn when the entry is built and
held by ``loss_fn``, which moves them to the output's device, so any caller can train any entry
the same way, on any device::

    model, args, kwargs, loss_fn = make("resnet")
    loss_fn(model(*args, **kwargs), *args).backward()

``size="tiny"`` runs a training step in milliseconds on CPU (tests); ``size="default"`` is
large enough for memory savings to matter and still runs on CPU (examples, benchmarks);
``size="large"`` (``gpt``, ``resnet``, ``hf_llama``, ``hf_bert``) is for a GPU bench: at
"default" a data-centre GPU's step is thousands of kernels of microseconds, timed by the host
issuing them, while "large" (GPT-2 small, ResNet-18, a 0.2B Llama, BERT-base shapes) keeps the
GPU busy, as the models people train do.

The entries cover what a rematerialization planner must handle: in-place ops and BatchNorm buffer
updates (``resnet``), long skip connections that stay alive across the whole network (``unet``),
random ops that must be replayed identically (dropout in ``gpt`` and ``hf_gpt2``), tied weights
(``gpt``, ``hf_gpt2``), keyword and non-tensor arguments with dict outputs (``multi_output``), and
third-party models (``hf_gpt2``; ``hf_llama`` and ``hf_bert``, called on keyword arguments with
labels as Hugging Face users call them, the loss the model's own; registered only when
``transformers`` is importable).
"""

from __future__ import annotations

import functools
import importlib.util
import math
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["ZOO", "Size", "ZooEntry", "gpt", "hf_bert", "hf_gpt2", "hf_llama", "make", "mlp", "multi_output", "resnet",
           "unet"]

Size = Literal["tiny", "default", "large"]


class ZooEntry(NamedTuple):
    model: nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    loss_fn: Callable[..., Tensor]  # loss_fn(output, *args) -> scalar


def _pick(size: str, tiny: dict[str, Any], default: dict[str, Any], **more: dict[str, Any]) -> dict[str, Any]:
    sizes = {"tiny": tiny, "default": default, **more}
    if size not in sizes:
        raise ValueError(f"unknown size {size!r}: expected one of {', '.join(map(repr, sizes))}")
    return sizes[size]


# --- mlp -------------------------------------------------------------------------------------


def mlp(size: Size = "tiny") -> ZooEntry:
    """Linear+GELU layers, a classifier head; cross-entropy on fixed random labels."""
    cfg = _pick(
        size,
        tiny={"batch": 256, "widths": (32, 64, 64, 10)},
        default={"batch": 256, "widths": (1024, 2048, 2048, 2048, 2048, 100)},
    )
    widths = cfg["widths"]
    layers: list[nn.Module] = []
    for i, (width_in, width_out) in enumerate(zip(widths[:-1], widths[1:])):
        layers.append(nn.Linear(width_in, width_out))
        if i < len(widths) - 2:  # no activation after the classifier
            layers.append(nn.GELU())
    x = torch.randn(cfg["batch"], widths[0])
    labels = torch.randint(0, widths[-1], (cfg["batch"],))

    def loss_fn(logits: Tensor, *_args: Any) -> Tensor:
        return F.cross_entropy(logits, labels.to(logits.device))

    return ZooEntry(nn.Sequential(*layers), (x,), {}, loss_fn)


# --- resnet ----------------------------------------------------------------------------------


class BasicBlock(nn.Module):
    """ResNet basic block, written like torchvision's: in-place ReLU and in-place residual add."""

    def __init__(self, channels_in: int, channels_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels_in, channels_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels_out)
        self.conv2 = nn.Conv2d(channels_out, channels_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels_out)
        self.relu = nn.ReLU(inplace=True)
        self.downsample: nn.Module = nn.Identity()
        if stride != 1 or channels_in != channels_out:
            self.downsample = nn.Sequential(
                nn.Conv2d(channels_in, channels_out, 1, stride=stride, bias=False),
                nn.BatchNorm2d(channels_out),
            )

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += self.downsample(x)  # safe in place: BatchNorm's backward needs its input, not output
        return self.relu(out)


class ResNet(nn.Module):
    def __init__(self, widths: tuple[int, ...], blocks_per_stage: int, num_classes: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, widths[0], 3, padding=1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU(inplace=True)
        )
        stages: list[nn.Module] = []
        channels = widths[0]
        for i, width in enumerate(widths):
            blocks = [BasicBlock(channels, width, stride=1 if i == 0 else 2)]
            blocks += [BasicBlock(width, width, stride=1) for _ in range(blocks_per_stage - 1)]
            stages.append(nn.Sequential(*blocks))
            channels = width
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(channels, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.flatten(self.pool(self.stages(self.stem(x))), 1))


def resnet(size: Size = "tiny") -> ZooEntry:
    """ResNet-style CNN on random images; cross-entropy on fixed random labels."""
    cfg = _pick(
        size,
        tiny={"batch": 8, "image": 16, "widths": (8, 16), "blocks": 1, "classes": 10},
        default={"batch": 16, "image": 64, "widths": (32, 64, 128, 256), "blocks": 2, "classes": 100},
        large={"batch": 64, "image": 224, "widths": (64, 128, 256, 512), "blocks": 2, "classes": 1000},
    )
    model = ResNet(cfg["widths"], cfg["blocks"], cfg["classes"])
    x = torch.randn(cfg["batch"], 3, cfg["image"], cfg["image"])
    labels = torch.randint(0, cfg["classes"], (cfg["batch"],))

    def loss_fn(logits: Tensor, *_args: Any) -> Tensor:
        return F.cross_entropy(logits, labels.to(logits.device))

    return ZooEntry(model, (x,), {}, loss_fn)


# --- gpt -------------------------------------------------------------------------------------


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.dropout = dropout
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        batch, seq, n_embd = x.shape
        q, k, v = self.c_attn(x).split(n_embd, dim=2)
        q, k, v = (t.view(batch, seq, self.n_head, n_embd // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).contiguous().view(batch, seq, n_embd)
        return self.resid_dropout(self.c_proj(y))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd), nn.Dropout(dropout)
        )

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """A GPT-2-style decoder (after nanoGPT); module paths read like HF's: ``transformer.h.0.attn``."""

    def __init__(
        self, vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int, dropout: float
    ) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(vocab_size, n_embd),
                "wpe": nn.Embedding(block_size, n_embd),
                "drop": nn.Dropout(dropout),
                "h": nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer)),
                "ln_f": nn.LayerNorm(n_embd),
            }
        )
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.transformer["wte"].weight  # tied, as in GPT-2
        # GPT-2's initialisation; PyTorch's default N(0, 1) embeddings give huge initial logits.
        for name, parameter in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(parameter, std=0.02 / math.sqrt(2 * n_layer))
            elif parameter.dim() == 2:
                nn.init.normal_(parameter, std=0.02)

    def forward(self, idx: Tensor) -> Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.transformer["drop"](self.transformer["wte"](idx) + self.transformer["wpe"](positions))
        for block in self.transformer["h"]:
            x = block(x)
        return self.lm_head(self.transformer["ln_f"](x))


def _next_token_loss(logits: Tensor, idx: Tensor, *_args: Any) -> Tensor:
    """Cross-entropy of predicting token t+1 from the logits at t."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))


def gpt(size: Size = "tiny") -> ZooEntry:
    """GPT-style decoder with dropout 0.1 and tied embeddings, on random token ids."""
    cfg = _pick(
        size,
        tiny={"batch": 8, "seq": 64, "vocab_size": 128, "n_layer": 2, "n_head": 2, "n_embd": 32},
        default={"batch": 4, "seq": 256, "vocab_size": 8192, "n_layer": 6, "n_head": 6, "n_embd": 384},
        large={"batch": 8, "seq": 1024, "vocab_size": 32768, "n_layer": 12, "n_head": 12, "n_embd": 768},
    )
    model = GPT(cfg["vocab_size"], cfg["seq"], cfg["n_layer"], cfg["n_head"], cfg["n_embd"], dropout=0.1)
    idx = torch.randint(0, cfg["vocab_size"], (cfg["batch"], cfg["seq"]))
    return ZooEntry(model, (idx,), {}, _next_token_loss)


# --- unet ------------------------------------------------------------------------------------


def _double_conv(channels_in: int, channels_out: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(channels_in, channels_out, 3, padding=1, bias=False),
        nn.BatchNorm2d(channels_out),
        nn.ReLU(inplace=True),
        nn.Conv2d(channels_out, channels_out, 3, padding=1, bias=False),
        nn.BatchNorm2d(channels_out),
        nn.ReLU(inplace=True),
    )


class Up(nn.Module):
    """Upsample (learned ConvTranspose, or bilinear then 1x1 conv), concat the skip, convolve."""

    def __init__(self, channels_in: int, channels_out: int, transpose: bool) -> None:
        super().__init__()
        self.up: nn.Module
        if transpose:
            self.up = nn.ConvTranspose2d(channels_in, channels_out, 2, stride=2)
        else:
            self.up = nn.Sequential(
                nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False),
                nn.Conv2d(channels_in, channels_out, 1),
            )
        self.conv = _double_conv(2 * channels_out, channels_out)

    def forward(self, x: Tensor, skip: Tensor) -> Tensor:
        return self.conv(torch.cat([self.up(x), skip], dim=1))


class UNet(nn.Module):
    def __init__(self, channels_in: int, num_classes: int, widths: tuple[int, ...]) -> None:
        super().__init__()
        self.down = nn.ModuleList()
        channels = channels_in
        for width in widths[:-1]:
            self.down.append(_double_conv(channels, width))
            channels = width
        self.pool = nn.MaxPool2d(2)
        self.bottleneck = _double_conv(channels, widths[-1])
        # Both upsampling styles appear: ConvTranspose on the deep levels, bilinear on the last.
        levels = list(zip(widths[::-1][:-1], widths[::-1][1:]))
        self.up = nn.ModuleList(
            Up(wide, narrow, transpose=i < len(levels) - 1) for i, (wide, narrow) in enumerate(levels)
        )
        self.head = nn.Conv2d(widths[0], num_classes, 1)

    def forward(self, x: Tensor) -> Tensor:
        skips = []  # long skip connections: each lives from its down level to its up level
        for down in self.down:
            x = down(x)
            skips.append(x)
            x = self.pool(x)
        x = self.bottleneck(x)
        for up, skip in zip(self.up, reversed(skips)):
            x = up(x, skip)
        return self.head(x)


def unet(size: Size = "tiny") -> ZooEntry:
    """UNet for segmentation of random images; per-pixel cross-entropy on a fixed random mask."""
    cfg = _pick(
        size,
        tiny={"batch": 4, "image": 16, "widths": (8, 16, 32), "classes": 3},
        default={"batch": 4, "image": 128, "widths": (16, 32, 64, 128, 256), "classes": 5},
    )
    model = UNet(3, cfg["classes"], cfg["widths"])
    x = torch.randn(cfg["batch"], 3, cfg["image"], cfg["image"])
    target = torch.randint(0, cfg["classes"], (cfg["batch"], cfg["image"], cfg["image"]))

    def loss_fn(logits: Tensor, *_args: Any) -> Tensor:
        return F.cross_entropy(logits, target.to(logits.device))

    return ZooEntry(model, (x,), {}, loss_fn)


# --- multi_output ----------------------------------------------------------------------------


class MultiHead(nn.Module):
    """A shared encoder with three outputs, a keyword-only tensor mask and a float scale."""

    def __init__(self, features_in: int, hidden: int, num_classes: int) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(features_in, hidden), nn.GELU(), nn.Linear(hidden, hidden))
        self.classifier = nn.Linear(hidden, num_classes)
        self.regressor = nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def forward(self, x: Tensor, *, mask: Tensor | None = None, scale: float = 1.0) -> dict[str, Tensor]:
        features = self.encoder(x)
        if mask is not None:
            features = features * mask.unsqueeze(-1)
        return {
            "logits": self.classifier(features) * scale,
            "regression": self.regressor(features).squeeze(-1),
            "features": features,
        }


def multi_output(size: Size = "tiny") -> ZooEntry:
    """Dict of outputs from keyword arguments; the loss mixes classification, regression, L2."""
    cfg = _pick(
        size,
        tiny={"batch": 256, "features": 16, "hidden": 32, "classes": 5},
        default={"batch": 512, "features": 512, "hidden": 2048, "classes": 100},
    )
    model = MultiHead(cfg["features"], cfg["hidden"], cfg["classes"])
    x = torch.randn(cfg["batch"], cfg["features"])
    mask = (torch.rand(cfg["batch"]) > 0.25).float()  # drop about a quarter of the samples
    labels = torch.randint(0, cfg["classes"], (cfg["batch"],))
    values = torch.randn(cfg["batch"])

    def loss_fn(output: dict[str, Tensor], *_args: Any) -> Tensor:
        return (
            F.cross_entropy(output["logits"], labels.to(output["logits"].device))
            + F.mse_loss(output["regression"], values.to(output["regression"].device))
            + 1e-3 * output["features"].pow(2).mean()
        )

    return ZooEntry(model, (x,), {"mask": mask, "scale": 0.5}, loss_fn)


# --- hf_gpt2 ---------------------------------------------------------------------------------

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


@functools.cache
def _gpt2_logits_class() -> type[nn.Module]:
    """``GPT2LMHeadModel`` returning a plain logits tensor, built once transformers is imported.

    Subclassing (rather than wrapping) keeps HF's module paths: ``transformer.h.0.attn``.
    """
    from transformers import GPT2LMHeadModel

    class GPT2Logits(GPT2LMHeadModel):
        def forward(self, input_ids: Tensor) -> Tensor:  # type: ignore[override]
            output = super().forward(input_ids, return_dict=False)
            return output[0]

    return GPT2Logits


def hf_gpt2(size: str = "tiny", n_layer: int | None = None, attn_implementation: str = "sdpa") -> ZooEntry:
    """Hugging Face GPT-2 with random weights (HF's default dropout 0.1); next-token loss.

    Needs ``transformers``; ``n_layer`` overrides the size's depth. Besides "tiny" and
    "default", ``size="gpt2"`` is GPT-2 small's shape (12 layers, 768 wide, vocabulary 50257)
    at sequence 512, batch 1: the planning-speed benchmark's model (124M parameters).
    """
    from transformers import GPT2Config

    cfg = _pick(
        size,
        tiny={"batch": 8, "seq": 64, "vocab_size": 128, "n_layer": 2, "n_head": 2, "n_embd": 32},
        default={"batch": 4, "seq": 256, "vocab_size": 8192, "n_layer": 6, "n_head": 6, "n_embd": 384},
        gpt2={"batch": 1, "seq": 512, "vocab_size": 50257, "n_layer": 12, "n_head": 12, "n_embd": 768},
    )
    config = GPT2Config(
        vocab_size=cfg["vocab_size"],
        n_positions=cfg["seq"],
        n_embd=cfg["n_embd"],
        n_layer=n_layer if n_layer is not None else cfg["n_layer"],
        n_head=cfg["n_head"],
        # GPT-2's special token 50256 lies outside a small vocabulary; HF warns about it.
        bos_token_id=cfg["vocab_size"] - 1,
        eos_token_id=cfg["vocab_size"] - 1,
        use_cache=False,
        attn_implementation=attn_implementation,
    )
    model = _gpt2_logits_class()(config)
    idx = torch.randint(0, cfg["vocab_size"], (cfg["batch"], cfg["seq"]))
    return ZooEntry(model, (idx,), {}, _next_token_loss)


# --- hf_llama, hf_bert -----------------------------------------------------------------------


def _output_loss(output: Any, *_args: Any) -> Tensor:
    """The loss a Hugging Face model computed from the ``labels`` it was given."""
    return output.loss


def _padded_batch(batch: int, seq: int, vocab_size: int) -> dict[str, Tensor]:
    """Random token ids and their padding mask, the last sequence left-padded by a quarter, as
    a tokenizer pads a batch of uneven texts: the mask is not all ones."""
    input_ids = torch.randint(0, vocab_size, (batch, seq))
    attention_mask = torch.ones(batch, seq, dtype=torch.long)
    attention_mask[-1, : seq // 4] = 0
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def hf_llama(size: str = "tiny") -> ZooEntry:
    """Hugging Face ``LlamaForCausalLM`` with random weights (grouped-query attention, RoPE,
    RMSNorm, SwiGLU), called as users call it: ``model(input_ids=..., attention_mask=...,
    labels=...)``, its loss ``output.loss`` (next-token, padded positions included as HF's
    default collator leaves them). Needs ``transformers``.

    ``use_cache=False``, as training scripts set it: a key/value cache is not trained on.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = _pick(
        size,
        tiny={"batch": 2, "seq": 32, "vocab_size": 128, "layers": 2, "hidden": 32, "ffn": 64, "heads": 4, "kv": 2},
        default={"batch": 4, "seq": 256, "vocab_size": 8192, "layers": 6, "hidden": 384, "ffn": 1024, "heads": 6,
                 "kv": 2},
        large={"batch": 8, "seq": 1024, "vocab_size": 32000, "layers": 8, "hidden": 1024, "ffn": 2816, "heads": 16,
               "kv": 4},
    )
    config = LlamaConfig(
        vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden"], intermediate_size=cfg["ffn"],
        num_hidden_layers=cfg["layers"], num_attention_heads=cfg["heads"], num_key_value_heads=cfg["kv"],
        max_position_embeddings=cfg["seq"], use_cache=False,
    )
    batch = _padded_batch(cfg["batch"], cfg["seq"], cfg["vocab_size"])
    return ZooEntry(LlamaForCausalLM(config), (), {**batch, "labels": batch["input_ids"]}, _output_loss)


def hf_bert(size: str = "tiny") -> ZooEntry:
    """Hugging Face ``BertForMaskedLM`` with random weights (HF's default dropout 0.1), called as
    users call it: ``model(input_ids=..., attention_mask=..., labels=...)`` with labels on a
    random 15% of the positions (-100 elsewhere, as HF's masked-LM collator writes them), its
    loss ``output.loss``. Needs ``transformers``."""
    from transformers import BertConfig, BertForMaskedLM

    cfg = _pick(
        size,
        tiny={"batch": 2, "seq": 32, "vocab_size": 128, "layers": 2, "hidden": 32, "ffn": 64, "heads": 4},
        default={"batch": 4, "seq": 256, "vocab_size": 8192, "layers": 6, "hidden": 384, "ffn": 1536, "heads": 6},
        large={"batch": 16, "seq": 512, "vocab_size": 30522, "layers": 12, "hidden": 768, "ffn": 3072, "heads": 12},
    )
    config = BertConfig(
        vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden"], intermediate_size=cfg["ffn"],
        num_hidden_layers=cfg["layers"], num_attention_heads=cfg["heads"], max_position_embeddings=cfg["seq"],
    )
    batch = _padded_batch(cfg["batch"], cfg["seq"], cfg["vocab_size"])
    chosen = torch.rand(cfg["batch"], cfg["seq"]) < 0.15
    chosen[:, -1] = True  # every sequence predicts at least one token (the last is never padding)
    labels = torch.where(chosen, batch["input_ids"], -100)
    return ZooEntry(BertForMaskedLM(config), (), {**batch, "labels": labels}, _output_loss)


# --- registry --------------------------------------------------------------------------------

ZOO: dict[str, Callable[..., ZooEntry]] = {
    "mlp": mlp,
    "resnet": resnet,
    "gpt": gpt,
    "unet": unet,
    "multi_output": multi_output,
}
if HAS_TRANSFORMERS:
    ZOO["hf_gpt2"] = hf_gpt2
    ZOO["hf_llama"] = hf_llama
    ZOO["hf_bert"] = hf_bert


def make(name: str, size: str = "tiny", seed: int = 0, **options: Any) -> ZooEntry:
    """Build zoo entry ``name`` with weights, inputs and targets drawn from ``seed``.

    The caller's global RNG state is left as it was; ``options`` go to the factory.
    """
    if name not in ZOO:
        raise KeyError(f"unknown zoo model {name!r}; available: {', '.join(ZOO)}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return ZOO[name](size, **options)


class WithLoss(nn.Module):
    """``model`` followed by its loss, as one module: planning it puts the loss inside the budget.

    The budget covers what runs inside the planned module; a loss computed outside it (a
    cross-entropy keeps its log-softmax, as large as the logits) is not planned.
    """

    def __init__(self, model: nn.Module, loss_fn: Callable[..., Tensor]) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, *args: Any, **kwargs: Any) -> Tensor:
        return self.loss_fn(self.model(*args, **kwargs), *args)
