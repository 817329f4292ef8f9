"""Healthy models nobody here designed, built from configs with random init (no downloads), and sick ones.

The healthy zoo is what the health rules must stay silent on; the sick networks are what they must still catch.

* Hugging Face ``transformers``: tiny GPT-2, BERT for classification and for masked LM, and a LLaMA-style model.
* :class:`ResNet18`: timm's ``resnet18`` layout and initialisation (``zero_init_last=True``: the last BatchNorm of
  every residual block starts at weight 0), narrower channels so it runs on 2 CPU cores in seconds.
* :class:`ViT`: timm's ``VisionTransformer`` layout and initialisation (``cls_token`` and ``pos_embed`` owned
  directly by the model, fused q/k/v projection, ``F.scaled_dot_product_attention``), tiny.
* :class:`LSTMClassifier`: embedding, a two-layer ``nn.LSTM`` and a linear head.

timm itself is not used: it imports torchvision at import time, and on PyPI no CPU build of torchvision matches the
torch build CI installs (the CUDA build pip picks fails on ``import torchvision``). The two timm models are written
out here from timm 1.0's ``resnet.py`` / ``vision_transformer.py``: the same module names, the same init.
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset


# ------------------------------------------------------------------------------------------------ timm resnet18
class BasicBlock(nn.Module):
    """timm ``BasicBlock``: conv-bn-act-conv-bn, residual add, act; ``zero_init_last`` zeroes ``bn2.weight``."""

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.drop_block = nn.Identity()
        self.act1 = nn.ReLU(inplace=True)
        self.aa = nn.Identity()
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.act2 = nn.ReLU(inplace=True)
        self.downsample = downsample

    def zero_init_last(self) -> None:
        nn.init.zeros_(self.bn2.weight)

    def forward(self, x: Tensor) -> Tensor:
        shortcut = x
        x = self.aa(self.act1(self.drop_block(self.bn1(self.conv1(x)))))
        x = self.bn2(self.conv2(x))
        if self.downsample is not None:
            shortcut = self.downsample(shortcut)
        return self.act2(x + shortcut)


class ResNet18(nn.Module):
    """timm ``resnet18`` (``zero_init_last=True``) with every channel count divided by ``64 // width``."""

    def __init__(self, num_classes: int = 10, width: int = 16) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.act1 = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        inplanes = width
        for i, (planes, stride) in enumerate(
            zip([width, 2 * width, 4 * width, 8 * width], [1, 2, 2, 2], strict=True), start=1
        ):
            downsample = None
            if stride != 1 or inplanes != planes:
                downsample = nn.Sequential(
                    nn.Conv2d(inplanes, planes, 1, stride=stride, bias=False), nn.BatchNorm2d(planes)
                )
            blocks = [BasicBlock(inplanes, planes, stride, downsample), BasicBlock(planes, planes)]
            setattr(self, f"layer{i}", nn.Sequential(*blocks))
            inplanes = planes
        self.global_pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(inplanes, num_classes)
        # timm ResNet.init_weights: kaiming_normal_(fan_out, relu) on every conv, then zero_init_last on blocks.
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        for m in self.modules():
            if hasattr(m, "zero_init_last"):
                m.zero_init_last()

    def forward(self, x: Tensor) -> Tensor:
        x = self.maxpool(self.act1(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(self.global_pool(x).flatten(1))


# ---------------------------------------------------------------------------------------------------- timm ViT
class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.q_norm = nn.Identity()
        self.k_norm = nn.Identity()
        self.attn_drop = nn.Dropout(0.0)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(0.0)

    def forward(self, x: Tensor) -> Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        x = F.scaled_dot_product_attention(self.q_norm(q), self.k_norm(k), v)
        return self.proj_drop(self.proj(x.transpose(1, 2).reshape(b, n, c)))


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.drop1 = nn.Dropout(0.0)
        self.norm = nn.Identity()
        self.fc2 = nn.Linear(hidden, dim)
        self.drop2 = nn.Dropout(0.0)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop2(self.fc2(self.norm(self.drop1(self.act(self.fc1(x))))))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, heads)
        self.ls1 = nn.Identity()
        self.drop_path1 = nn.Identity()
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(dim, 4 * dim)
        self.ls2 = nn.Identity()
        self.drop_path2 = nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.drop_path1(self.ls1(self.attn(self.norm1(x))))
        return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))


class PatchEmbed(nn.Module):
    def __init__(self, patch: int, dim: int) -> None:
        super().__init__()
        self.proj = nn.Conv2d(3, dim, patch, stride=patch)
        self.norm = nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        return self.norm(self.proj(x).flatten(2).transpose(1, 2))


class ViT(nn.Module):
    """timm ``VisionTransformer`` (class token, learned position embedding, pre-norm blocks, default init)."""

    def __init__(
        self, image: int = 16, patch: int = 4, dim: int = 32, depth: int = 4, heads: int = 2, num_classes: int = 10
    ) -> None:
        super().__init__()
        self.patch_embed = PatchEmbed(patch, dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, (image // patch) ** 2 + 1, dim))
        self.pos_drop = nn.Dropout(0.0)
        self.blocks = nn.Sequential(*[Block(dim, heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.head_drop = nn.Dropout(0.0)
        self.head = nn.Linear(dim, num_classes)
        # timm init_weights(mode=""): pos_embed trunc_normal(.02), cls_token normal(1e-6), Linear trunc_normal(.02)
        # with zero bias; conv and LayerNorm keep PyTorch's defaults.
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.normal_(self.cls_token, std=1e-6)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                nn.init.zeros_(m.bias)

    def forward(self, x: Tensor) -> Tensor:
        x = self.patch_embed(x)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = self.norm(self.blocks(self.pos_drop(x + self.pos_embed)))
        return self.head(self.head_drop(x[:, 0]))


# -------------------------------------------------------------------------------------------------------- LSTM
class LSTMClassifier(nn.Module):
    def __init__(self, vocab: int = 50, dim: int = 32, num_classes: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.lstm = nn.LSTM(dim, dim, num_layers=2, batch_first=True)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        out, _ = self.lstm(self.embed(x))
        return self.head(out[:, -1])


# ------------------------------------------------------------------------------------------- Hugging Face models
VOCAB = 64
SEQ = 16


def hf_model(kind: str) -> nn.Module:
    """A tiny ``transformers`` model built from a config (random init, nothing downloaded)."""
    import transformers as T

    common: dict[str, Any] = {"vocab_size": VOCAB}
    if kind == "gpt2":
        config = T.GPT2Config(n_embd=32, n_layer=2, n_head=2, n_positions=SEQ, **common)
        return T.GPT2LMHeadModel(config)
    if kind == "llama":
        config = T.LlamaConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=SEQ,
            **common,
        )
        return T.LlamaForCausalLM(config)
    config = T.BertConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=SEQ,
        num_labels=2,
        **common,
    )
    if kind == "bert_cls":
        return T.BertForSequenceClassification(config)
    if kind == "bert_mlm":
        return T.BertForMaskedLM(config)
    raise ValueError(f"unknown Hugging Face model kind {kind!r}")


# ------------------------------------------------------------------------------------------------- Lightning glue
class ZooModule(pl.LightningModule):
    """Trains ``model`` on a fixed synthetic task with AdamW; ``task`` says how batches turn into a loss."""

    def __init__(self, model: nn.Module, task: str, data: TensorDataset, batch_size: int = 8, lr: float = 1e-3) -> None:
        super().__init__()
        self.model = model
        self.task = task
        self.data = data
        self.batch_size = batch_size
        self.lr = lr

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        if self.task == "hf_lm":  # causal LM: labels are the inputs, shifted inside the model
            return self.model(input_ids=x, labels=x).loss
        if self.task == "hf_labels":  # sequence classification or masked LM: labels given
            return self.model(input_ids=x, labels=y).loss
        out = self.model(x)
        return F.cross_entropy(out, y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.batch_size, shuffle=False)


def _tokens(n: int, seed: int, vocab: int = VOCAB) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, SEQ), generator=g)


def zoo_module(name: str, n: int, seed: int = 0) -> ZooModule:
    """One healthy zoo member with ``n`` training samples (an epoch of ``n / 8`` steps)."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 1)
    if name in ("gpt2", "llama"):
        x = _tokens(n, seed)
        return ZooModule(hf_model(name), "hf_lm", TensorDataset(x, x))
    if name == "bert_cls":
        x = _tokens(n, seed)
        # A learnable label: whether the first token is in the lower half of the vocabulary.
        return ZooModule(hf_model(name), "hf_labels", TensorDataset(x, (x[:, 0] < VOCAB // 2).long()))
    if name == "bert_mlm":
        x = _tokens(n, seed)
        mask = torch.rand(x.shape, generator=g) < 0.15
        mask[:, 0] = True  # at least one predicted position per sequence
        labels = torch.where(mask, x, torch.full_like(x, -100))
        return ZooModule(hf_model(name), "hf_labels", TensorDataset(torch.where(mask, 3, x), labels))
    if name == "resnet18":
        images, labels = torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g)
        return ZooModule(ResNet18(), "classify", TensorDataset(images, labels))
    if name == "vit":
        images, labels = torch.randn(n, 3, 16, 16, generator=g), torch.randint(0, 10, (n,), generator=g)
        return ZooModule(ViT(), "classify", TensorDataset(images, labels))
    if name == "lstm":
        x = _tokens(n, seed, vocab=50)
        return ZooModule(LSTMClassifier(), "classify", TensorDataset(x, x[:, 0] % 4))
    raise ValueError(f"unknown zoo member {name!r}")


ZOO = ("gpt2", "bert_cls", "bert_mlm", "llama", "resnet18", "vit", "lstm")


# ------------------------------------------------------------------------------------------------ sick networks
def sigmoid_stack(depth: int = 10, width: int = 32) -> nn.Sequential:
    """Vanishing: ``depth`` Linear + Sigmoid blocks with PyTorch's default init (derivative <= 1/4 per block)."""
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Sigmoid()]
    return nn.Sequential(*layers, nn.Linear(width, 1))


def gain3_linear_stack(depth: int = 10, width: int = 32) -> nn.Sequential:
    """Exploding: ``depth`` bias-free Linear layers, orthogonal init with gain 3 (x3 per layer, both ways)."""
    layers = [nn.Linear(width, width, bias=False) for _ in range(depth)]
    for layer in layers:
        nn.init.orthogonal_(layer.weight, gain=3.0)
    return nn.Sequential(*layers, nn.Linear(width, 1))


def negative_bias_net(width: int = 32) -> nn.Sequential:
    """Dead units: a ReLU behind a Linear whose bias is -100, far below any pre-activation."""
    net = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 1))
    with torch.no_grad():
        net[2].bias.fill_(-100.0)
    return net


class PlantedNaN(nn.Module):
    """Identity, except that element 0 of every output is NaN."""

    def forward(self, x: Tensor) -> Tensor:
        return x.index_fill(-1, torch.tensor([0], device=x.device), math.nan)


def planted_nan_net(width: int = 32) -> nn.Sequential:
    return nn.Sequential(nn.Linear(width, width), nn.ReLU(), PlantedNaN(), nn.Linear(width, 1))
