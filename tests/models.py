"""The model zoo of the tests and benchmarks: real architectures from configs, random weights, CPU sizes.

Each factory returns a :class:`Case`: the model, example args/kwargs, and a seed. Sizes are chosen so that
activations dominate the step (otherwise there is nothing to plan) and one step takes well under a second.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class Case:
    name: str
    model: nn.Module
    args: tuple
    kwargs: dict = field(default_factory=dict)


def _quiet_transformers():
    import transformers
    transformers.logging.set_verbosity_error()
    return transformers


def hf_layer_checkpointing(model, on: bool = True) -> None:
    """Hugging Face's per-layer checkpointing (non-reentrant) on or off: transformers 5's
    ``activation_checkpointing_*``, the older (now deprecated) ``gradient_checkpointing_*`` before it."""
    name = "activation" if hasattr(model, "activation_checkpointing_enable") else "gradient"
    if on:
        getattr(model, f"{name}_checkpointing_enable")(**{f"{name}_checkpointing_kwargs": {"use_reentrant": False}})
    else:
        getattr(model, f"{name}_checkpointing_disable")()


def gpt2(layers: int = 3) -> Case:
    t = _quiet_transformers()
    cfg = t.GPT2Config(n_layer=layers, n_embd=64, n_head=4, vocab_size=256, n_positions=128, use_cache=False,
                       bos_token_id=0, eos_token_id=0)
    return Case("gpt2", t.GPT2LMHeadModel(cfg), (torch.randint(0, 256, (4, 64)),))


def bert() -> Case:
    t = _quiet_transformers()
    cfg = t.BertConfig(num_hidden_layers=3, hidden_size=64, num_attention_heads=4, intermediate_size=256,
                       vocab_size=256, max_position_embeddings=128)
    ids = torch.randint(0, 256, (4, 64))
    mask = torch.ones(4, 64, dtype=torch.long)
    mask[:, 48:] = 0
    return Case("bert", t.BertForMaskedLM(cfg), (ids,), {"attention_mask": mask})


def llama(layers: int = 3, batch: int = 4, sequence: int = 64) -> Case:
    t = _quiet_transformers()
    cfg = t.LlamaConfig(num_hidden_layers=layers, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=192, vocab_size=256, max_position_embeddings=128, use_cache=False,
                        attn_implementation="eager",
                        bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return Case("llama", t.LlamaForCausalLM(cfg), (torch.randint(0, 256, (batch, sequence)),))


def t5() -> Case:
    t = _quiet_transformers()
    cfg = t.T5Config(num_layers=2, num_decoder_layers=2, d_model=64, d_kv=16, num_heads=4, d_ff=192,
                     vocab_size=256, use_cache=False, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    ids = torch.randint(0, 256, (4, 32))
    return Case("t5", t.T5ForConditionalGeneration(cfg), (ids,), {"decoder_input_ids": ids[:, :24]})


def vit() -> Case:
    t = _quiet_transformers()
    cfg = t.ViTConfig(image_size=32, patch_size=4, num_channels=3, hidden_size=64, num_hidden_layers=3,
                      num_attention_heads=4, intermediate_size=192, num_labels=10)
    return Case("vit", t.ViTForImageClassification(cfg), (torch.randn(4, 3, 32, 32),))


def transformer_encoder() -> Case:
    layer = nn.TransformerEncoderLayer(d_model=64, nhead=4, dim_feedforward=256, dropout=0.1, batch_first=True)
    return Case("transformer_encoder", nn.TransformerEncoder(layer, num_layers=3, enable_nested_tensor=False),
                (torch.randn(4, 64, 64),))


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.short = nn.Sequential() if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += self.short(x)
        return self.relu(out)


class ResNet(nn.Module):
    """A small ResNet with BatchNorm and in-place ReLUs."""

    def __init__(self, width: int = 16, blocks: int = 2, classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True))
        layers, cin = [], width
        for stage, cout in enumerate((width, 2 * width, 4 * width)):
            for b in range(blocks):
                layers.append(BasicBlock(cin, cout, stride=2 if (b == 0 and stage > 0) else 1))
                cin = cout
        self.layers = nn.Sequential(*layers)
        self.head = nn.Linear(cin, classes)

    def forward(self, x):
        x = self.layers(self.stem(x))
        return self.head(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def resnet() -> Case:
    return Case("resnet", ResNet(), (torch.randn(8, 3, 32, 32),))


class UNet(nn.Module):
    """A U-Net: encoder, decoder, concatenated skip connections."""

    def __init__(self, width: int = 8, depth: int = 3):
        super().__init__()
        def block(cin, cout):
            return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.GroupNorm(1, cout), nn.SiLU(),
                                 nn.Conv2d(cout, cout, 3, padding=1), nn.SiLU())
        self.down = nn.ModuleList()
        self.up = nn.ModuleList()
        cin, widths = 3, []
        for d in range(depth):
            cout = width * 2 ** d
            self.down.append(block(cin, cout))
            widths.append(cout)
            cin = cout
        self.mid = block(cin, cin)
        for cout in reversed(widths):
            self.up.append(block(cin + cout, cout))
            cin = cout
        self.out = nn.Conv2d(cin, 3, 1)

    def forward(self, x):
        skips = []
        for block in self.down:
            x = block(x)
            skips.append(x)
            x = F.max_pool2d(x, 2)
        x = self.mid(x)
        for block in self.up:
            x = F.interpolate(x, scale_factor=2.0, mode="nearest")
            x = block(torch.cat([x, skips.pop()], dim=1))
        return self.out(x)


def unet() -> Case:
    return Case("unet", UNet(), (torch.randn(4, 3, 32, 32),))


from autorecompute._demo_model import GPT  # noqa: E402  (the demo model is the same GPT)


def gpt() -> Case:
    return Case("gpt", GPT(), (torch.randint(0, 256, (4, 64)),))


class MLP(nn.Module):
    """A deep MLP: Linear + GELU, 24 layers."""

    def __init__(self, layers: int = 24, d: int = 128):
        super().__init__()
        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(d, d), nn.GELU()) for _ in range(layers)])

    def forward(self, x):
        return self.layers(x)


def mlp() -> Case:
    return Case("mlp", MLP(), (torch.randn(1024, 128),))


class VGG(nn.Module):
    """A VGG-style stack of 3x3 convolutions with BatchNorm and max-pooling (Checkmate's VGG19 shape)."""

    def __init__(self, widths=(16, 16, "M", 32, 32, "M", 64, 64, 64, "M", 128, 128, 128, "M"), classes: int = 10):
        super().__init__()
        layers, cin = [], 3
        for w in widths:
            if w == "M":
                layers.append(nn.MaxPool2d(2))
            else:
                layers += [nn.Conv2d(cin, w, 3, padding=1), nn.BatchNorm2d(w), nn.ReLU(inplace=True)]
                cin = w
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(cin * 4, classes)

    def forward(self, x):
        return self.head(torch.flatten(self.features(x), 1))


def vgg(batch: int = 8) -> Case:
    return Case("vgg", VGG(), (torch.randn(batch, 3, 32, 32),))


ZOO: dict[str, Callable[[], Case]] = {
    "gpt2": gpt2, "bert": bert, "llama": llama, "t5": t5, "vit": vit,
    "transformer_encoder": transformer_encoder, "resnet": resnet, "unet": unet, "gpt": gpt, "mlp": mlp,
}


ALL: dict[str, Callable[[], Case]] = {**ZOO, "vgg": vgg}   # the benchmarks add a VGG-style net


def gpt_wide_batch() -> Case:
    """The GPT-style decoder at batch 16: activations dominate the step, as when a model does not fit."""
    return Case("gpt_wide_batch", GPT(), (torch.randint(0, 256, (16, 64)),))


def resnet_wide_batch() -> Case:
    """The ResNet-style CNN at batch 32 (activations dominate)."""
    return Case("resnet_wide_batch", ResNet(), (torch.randn(32, 3, 32, 32),))


ACTIVATION_HEAVY: dict[str, Callable[[], Case]] = {"gpt": gpt_wide_batch, "resnet": resnet_wide_batch}


# The benchmark suite's sizes, where they differ from the tests': the step of a model that does not fit is
# mostly activations, and at the tests' sizes Llama's parameters, their gradients and its logits with their
# gradient — what is on the device at the end of backward whatever the plan — are 0.51× of √N's peak, and
# VGG's parameters and gradients 0.54×: no plan could go below half √N's peak there (goal 2b). Four layers
# over 128 tokens at batch 8, and VGG at batch 16, are sizes where activations dominate as in training.
BENCHMARK: dict[str, Callable[[], Case]] = {
    **ALL,
    "llama": lambda: llama(layers=4, batch=8, sequence=128),
    "vgg": lambda: vgg(batch=16),
}


def make(name: str, seed: int = 0, benchmark: bool = False) -> Case:
    """Builds model ``name`` with ``torch.manual_seed(seed)`` (same seed → same weights and inputs), at the
    benchmark suite's size when ``benchmark``."""
    torch.manual_seed(seed)
    return (BENCHMARK if benchmark else ALL)[name]()
