"""The model zoo, and any other model by name: ``build(name, batch_size=None, image_size=None, device="meta",
**options) -> (model, example_input, loss_fn)``.

Zoo nets are the seven networks of Kusumoto et al.'s Table 1 at its input and batch sizes (``PAPER_NETS``), and
two transformers. Models are built in training mode; on ``meta`` nothing is allocated. Choices where the
paper's Chainer models cannot be had exactly:
- ``pspnet``: segmentation-models-pytorch's PSPNet on a dilated ResNet-101 (all five encoder stages,
  output stride 8, the ChainerCV layout), 19 classes (Cityscapes, the dataset of the 713x713 crop).
  smp needs sides divisible by the output stride 8, so the input is 712x712, the nearest to 713.
- ``unet``: the original U-Net of Ronneberger et al. (unpadded 3x3 convolutions, crop and concatenate),
  572x572 input, 2 classes, written here: it is the network the paper ran, 388x388 output.
- ``resnet50``, ``resnet152``, ``vgg19``, ``densenet161``, ``googlenet``: torchvision at 224x224, 1000
  classes; GoogLeNet without its auxiliary classifiers (torchvision's has batch norm after every conv).
- ``vit_b_16``: torchvision's ViT-B/16 at 224x224, batch 64, dropout 0.1 in the MLPs and attention.
- ``gpt2``: GPT-2 small (``GPT2`` below), sequence 1024, batch 8, next-token cross-entropy. For token
  inputs ``image_size`` is the sequence length.
- ``llama_1b`` and ``llama_8b``: Llama-class decoders as Hugging Face ``transformers`` builds them
  (``LlamaForCausalLM``, SDPA attention, parameters in bfloat16 as their configs say), never pretrained:
  ``llama_1b`` has Llama 3.2 1B's shape (16 layers, hidden 2048, 32 query and 8 key-value heads, tied
  embeddings; 1.24B parameters), sequence 2048, batch 4; ``llama_8b`` Llama 3.1 8B's (32 layers, hidden
  4096, MLP 14336, 32 query and 8 key-value heads; 8.03B parameters), sequence 4096, batch 1. Both have a
  vocabulary of 128,256 and need ``transformers`` (``pip install '.[hf]'``).

Other models are named ``SOURCE:NAME`` (``harness.zoo.models``: ``torchvision:convnext_tiny``,
``timm:vit_small_patch16_224``, ``module:my_pkg.models:build``).

NOTE [imported where used]
Every cell is a fresh process, and its imports are part of what a user waits for. torchvision adds 1.6 s to torch's
2.3, segmentation-models-pytorch 2.7 s, torch.compile's dynamo and inductor 3 s. So the model libraries are imported
by the builders of the nets that use them, the compiler's modules by the functions that compile
(``harness/execute/compiled.py``), and pandas (0.6 s) by what reads rows into tables
(``harness.results.load_results``, the benchmarks): an eager U-Net or GPT-2 cell pays for none of them, and a cell
writes its row without pandas. Every other import is at the top of its module.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from harness.zoo import models
from harness.zoo.netspec import (LOSSES, NetSpec, classification_loss, next_token_loss,  # noqa: F401  (the zoo's API)
                             segmentation_loss, sum_loss)


def _torchvision(name: str, **kwargs) -> Callable[[], nn.Module]:
    def build():
        import torchvision

        return getattr(torchvision.models, name)(weights=None, **kwargs)

    return build


def _pspnet() -> nn.Module:
    import segmentation_models_pytorch as smp

    return SmpForward(smp.PSPNet("resnet101", encoder_weights=None, encoder_depth=5, output_stride=8,
                                 upsampling=8, classes=19))


class SmpForward(nn.Module):
    """smp's ``SegmentationModel.forward`` without its input-shape check, which torch.fx cannot trace
    (``build`` checks the shape instead)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model.segmentation_head(self.model.decoder(self.model.encoder(x)))


class UNet(nn.Module):
    """Ronneberger et al. 2015: four 2x2 max-pool steps down, four 2x2 up-convolutions up, unpadded 3x3
    convolutions, skip connections cropped to size and concatenated."""

    def __init__(self, in_channels: int = 3, classes: int = 2, width: int = 64):
        super().__init__()
        widths = [width * 2 ** i for i in range(5)]
        self.down = nn.ModuleList()
        channels = in_channels
        for w in widths:
            self.down.append(_double_conv(channels, w))
            channels = w
        self.up = nn.ModuleList(nn.ConvTranspose2d(w * 2, w, 2, stride=2) for w in reversed(widths[:-1]))
        self.up_conv = nn.ModuleList(_double_conv(w * 2, w) for w in reversed(widths[:-1]))
        self.pool = nn.MaxPool2d(2)
        self.head = nn.Conv2d(width, classes, 1)

    def forward(self, x):
        skips = []
        for i, block in enumerate(self.down):
            x = block(x if i == 0 else self.pool(x))
            skips.append(x)
        for up, block, skip in zip(self.up, self.up_conv, reversed(skips[:-1])):
            x = up(x)
            x = block(torch.cat([_center_crop(skip, x), x], dim=1))
        return self.head(x)


def _double_conv(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3), nn.ReLU(inplace=True),
                         nn.Conv2d(c_out, c_out, 3), nn.ReLU(inplace=True))


def _unet_side_ok(side: int) -> bool:
    """Every pooling must see an even side and the output must keep at least one pixel."""
    for _ in range(4):
        side -= 4
        if side <= 0 or side % 2:
            return False
        side //= 2
    side -= 4
    for _ in range(4):
        side = 2 * side - 4
    return side > 0


def _center_crop(skip: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    # Sizes are static for a given input, so fx records plain slices.
    top = (skip.shape[-2] - like.shape[-2]) // 2
    left = (skip.shape[-1] - like.shape[-1]) // 2
    return skip[:, :, top:top + like.shape[-2], left:left + like.shape[-1]]


class GPT2(nn.Module):
    """GPT-2 small (Radford et al. 2019): learned token and position embeddings, pre-norm blocks of causal
    self-attention (``F.scaled_dot_product_attention``) and a GELU MLP, a final LayerNorm and an output
    layer tied to the token embedding; dropout 0.1 on the embeddings, the attention and each residual."""

    def __init__(self, vocab_size: int = 50257, context: int = 1024, width: int = 768, depth: int = 12,
                 heads: int = 12, dropout: float = 0.1):
        super().__init__()
        self.embed = GPT2Embedding(vocab_size, context, width, dropout)
        self.blocks = nn.ModuleList(GPT2Block(width, heads, dropout) for _ in range(depth))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab_size, bias=False)
        self.lm_head.weight = self.embed.wte.weight  # tied embeddings
        for name, p in self.named_parameters():  # GPT-2's initialisation, residual projections scaled down
            if p.dim() == 2:
                residual = name.endswith(("c_proj.weight", "mlp.2.weight"))
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * depth) if residual else 0.02)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class GPT2Embedding(nn.Module):
    def __init__(self, vocab_size: int, context: int, width: int, dropout: float):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab_size, width), nn.Embedding(context, width)
        self.drop = nn.Dropout(dropout)

    def forward(self, tokens):
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.drop(self.wte(tokens) + self.wpe(positions))


class GPT2Block(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(width), CausalSelfAttention(width, heads, dropout)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(approximate="tanh"), nn.Linear(4 * width, width),
                                 nn.Dropout(dropout))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.c_attn, self.c_proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x):
        batch, length, width = x.shape
        qkv = self.c_attn(x).view(batch, length, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], dropout_p=self.dropout if self.training else 0.0,
                                           is_causal=True)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(batch, length, width)))


def _vit_b_16() -> nn.Module:
    import torchvision

    return torchvision.models.vit_b_16(weights=None, dropout=0.1, attention_dropout=0.1)


def _vit_tokens(model: nn.Module, x):
    """torchvision ViT's forward after ``conv_proj``: patches as a sequence, the class token in front."""
    x = x.flatten(2).permute(0, 2, 1)
    return torch.cat([model.class_token.expand(x.shape[0], -1, -1), x], dim=1)


def _vit_position(model: nn.Module, x):
    return x + model.encoder.pos_embedding


# Steps of a sequence that need the model (``sequence``): name -> model -> function of the running value.
MODEL_STEPS = {
    "vit.tokens": lambda model: partial(_vit_tokens, model),
    "vit.position": lambda model: partial(_vit_position, model),
}


def _instances(*class_names: str) -> Callable[[nn.Module], list[str]]:
    return lambda model: [path for path, m in model.named_modules() if type(m).__name__ in class_names]


def _vgg_stages(model: nn.Module) -> list[str]:
    """VGG's stages: ``features`` cut after each max-pooling."""
    cuts = [0] + [i + 1 for i, m in enumerate(model.features) if isinstance(m, nn.MaxPool2d)]
    return [f"features[{a}:{b}]" for a, b in zip(cuts, cuts[1:])]


def _children(parent: str = "", before: dict[str, str] | None = None) -> Callable[[nn.Module], list[str]]:
    """The children of module ``parent`` in order, each preceded by its functional step in ``before``."""
    def sequence(model: nn.Module) -> list[str]:
        prefix = f"{parent}." if parent else ""
        steps = []
        for name, _ in (model.get_submodule(parent) if parent else model).named_children():
            steps += [before[name]] if name in (before or {}) else []
            steps.append(prefix + name)
        return steps

    return sequence


def _resnet_sequence(model: nn.Module, prefix: str = "", stem=("conv1", "bn1", "relu", "maxpool")) -> list[str]:
    layers = [f"{prefix}{layer}.{i}" for layer in ("layer1", "layer2", "layer3", "layer4")
              for i in range(len(model.get_submodule(prefix + layer)))]
    return [prefix + name for name in stem] + layers


# Functional steps a sequence may hold besides module paths.
FUNCTIONAL = {
    "F.flatten": lambda x: torch.flatten(x, 1),
    "F.relu": F.relu,
    "F.global_avg_pool": lambda x: F.adaptive_avg_pool2d(x, (1, 1)),
    "F.class_token": lambda x: x[:, 0],
}

NETS = {
    "pspnet": NetSpec(_pspnet, batch_size=2, image_size=712, paper_nodes=385, paper_vanilla_gb=9.4, loss="segmentation",
                      valid_side=lambda side: side >= 32 and side % 8 == 0, side_rule="a multiple of 8, at least 32",
                      blocks=lambda model: [f"model.encoder.layer{i}" for i in range(1, 5)] + ["model.decoder.psp"],
                      sequence=lambda model: _resnet_sequence(model, "model.encoder.") + [
                          "model.decoder.psp", "model.decoder.conv", "model.decoder.dropout", "model.segmentation_head"]),
    "unet": NetSpec(UNet, batch_size=8, image_size=572, paper_nodes=60, paper_vanilla_gb=9.1, loss="segmentation",
                    valid_side=_unet_side_ok, side_rule="one whose four poolings all see even sides (572, 188)",
                    blocks=lambda model: [f"down.{i}" for i in range(len(model.down))]
                    + [f"up_conv.{i}" for i in range(len(model.up_conv))]),
    "resnet50": NetSpec(_torchvision("resnet50"), batch_size=96, image_size=224, paper_nodes=176, paper_vanilla_gb=8.9,
                        blocks=_instances("Bottleneck"),
                        sequence=lambda model: _resnet_sequence(model) + ["avgpool", "F.flatten", "fc"]),
    "resnet152": NetSpec(_torchvision("resnet152"), batch_size=48, image_size=224, paper_nodes=516, paper_vanilla_gb=9.2,
                         blocks=_instances("Bottleneck"),
                         sequence=lambda model: _resnet_sequence(model) + ["avgpool", "F.flatten", "fc"]),
    "vgg19": NetSpec(_torchvision("vgg19"), batch_size=64, image_size=224, paper_nodes=46, paper_vanilla_gb=7.0,
                     blocks=_vgg_stages,
                     sequence=lambda model: _children("features")(model) + ["avgpool", "F.flatten"]
                     + _children("classifier")(model)),
    "densenet161": NetSpec(_torchvision("densenet161"), batch_size=32, image_size=224, paper_nodes=568, paper_vanilla_gb=8.5,
                           blocks=_instances("_DenseLayer", "_Transition"),
                           sequence=lambda model: _children("features")(model)
                           + ["F.relu", "F.global_avg_pool", "F.flatten", "classifier"]),
    "googlenet": NetSpec(_torchvision("googlenet", aux_logits=False, init_weights=False), batch_size=256,
                         image_size=224, paper_nodes=134, paper_vanilla_gb=8.5, blocks=_instances("Inception"),
                         sequence=_children(before={"dropout": "F.flatten"})),
    "vit_b_16": NetSpec(_vit_b_16, batch_size=64, image_size=224, valid_side=lambda side: side == 224,
                        side_rule="224 (torchvision fixes ViT-B/16's side; +net=torchvision net.name=vit_b_16 "
                                  "net.options.kwargs.image_size=N for another)",
                        blocks=_instances("EncoderBlock"),
                        sequence=lambda model: ["conv_proj", "vit.tokens", "vit.position", "encoder.dropout"]
                        + [f"encoder.layers.{name}" for name, _ in model.encoder.layers.named_children()]
                        + ["encoder.ln", "F.class_token", "heads"]),
    "gpt2": NetSpec(GPT2, batch_size=8, image_size=1024, loss="next_token", input="tokens", vocab_size=50257,
                    valid_side=lambda side: 2 <= side <= 1024, side_rule="between 2 and GPT-2's context of 1024",
                    blocks=_instances("GPT2Block"),
                    sequence=lambda model: ["embed", *(f"blocks.{i}" for i in range(len(model.blocks))), "ln_f",
                                            "lm_head"]),
}


def _llama(**shape) -> Callable[[], nn.Module]:
    """A ``transformers`` Llama of ``shape`` (config fields) in bfloat16 (``dtype``: another), fed token ids alone."""
    def build(dtype: torch.dtype = torch.bfloat16):
        try:
            import transformers
        except ImportError as error:
            raise ImportError(f"the zoo's Llama nets need Hugging Face transformers: pip install '.[hf]' "
                              f"({error})") from error
        config = transformers.LlamaConfig(vocab_size=128256, num_attention_heads=32, num_key_value_heads=8,
                                          max_position_embeddings=8192, rope_theta=500000.0, dtype="bfloat16",
                                          attn_implementation="sdpa", **shape)
        return models.CausalLM(transformers.AutoModelForCausalLM.from_config(config, dtype=dtype))

    return build


def _llama_spec(shape: dict, batch_size: int, sequence: int) -> NetSpec:
    return NetSpec(_llama(**shape), batch_size=batch_size, image_size=sequence, loss="next_token", input="tokens",
                   vocab_size=128256, dtype="bfloat16", valid_side=lambda side: 2 <= side <= 8192,
                   side_rule="between 2 and 8192 (the config's max_position_embeddings)",
                   blocks=models.decoder_layers)


NETS["llama_1b"] = _llama_spec(dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, head_dim=64,
                                    tie_word_embeddings=True), batch_size=4, sequence=2048)
NETS["llama_8b"] = _llama_spec(dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                    tie_word_embeddings=False), batch_size=1, sequence=4096)

PAPER_NETS = ("pspnet", "unet", "resnet50", "resnet152", "vgg19", "densenet161", "googlenet")  # Kusumoto et al.'s


def available() -> list[str]:
    """The zoo's nets (any other model goes by ``SOURCE:NAME``, ``harness.zoo.models``)."""
    return sorted(NETS)


def spec(name: str, **options) -> NetSpec:
    """The zoo's net ``name``, or a model from another source named ``SOURCE:NAME`` (``harness.zoo.models``);
    ``options`` are a source model's (its builder's keyword arguments, input and loss)."""
    if ":" in name:
        return models.spec(name, **options)
    if name not in NETS:
        raise KeyError(f"unknown net {name!r}; valid nets: {', '.join(available())}, or SOURCE:NAME for "
                       f"another model (sources: torchvision, timm, module, hf; see harness/zoo/models.py)")
    if options:
        raise ValueError(f"zoo net {name!r} takes no options, got {sorted(options)}")
    return NETS[name]


DTYPES = ("float32", "bfloat16", "float16", "float64")  # what a run trains in: its parameters and input


def check_dtype(dtype: str) -> torch.dtype:
    """The torch dtype named ``dtype``; a name not in ``DTYPES`` fails, listing them."""
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; valid: {', '.join(DTYPES)}")
    return getattr(torch, dtype)


def build(name: str, batch_size: int | None = None, image_size: int | None = None, device: str = "meta",
          dtype: str | None = None, **options):
    """``(model, example_input, loss_fn)`` for net ``name``; sizes default to the net's (Kusumoto et al.'s for its
    nets). A token input's loss is next-token cross-entropy against the input itself. The model and a
    float input are in ``dtype`` (``DTYPES``; None: the net's own, float32 but for the Llamas' bfloat16): a run
    trains in it, as a model cast with ``.to(dtype)`` does."""
    net = spec(name, **options)
    dtype = net.dtype if dtype is None else dtype
    torch_dtype = check_dtype(dtype)
    batch_size = net.batch_size if batch_size is None else batch_size
    image_size = net.image_size if image_size is None else image_size
    _check_sizes(net, name, batch_size, image_size)
    try:
        with torch.device(device):
            model = net.build_model()
    except NotImplementedError:  # a constructor that computes on tensors (RegNet's widths) cannot run on meta
        if device != "meta":
            raise
        model = net.build_model().to("meta")
    model.train()
    if net.input == "tokens":
        generator = torch.Generator().manual_seed(0)
        example_input = torch.randint(0, net.vocab_size, (batch_size, image_size), generator=generator).to(device)
    else:
        example_input = torch.randn(batch_size, net.channels, image_size, image_size, device=device)
    if dtype != net.dtype:  # a model that keeps some state in another float type keeps it by default
        model.to(torch_dtype)
        example_input = example_input.to(torch_dtype) if example_input.is_floating_point() else example_input
    loss_fn = LOSSES[net.loss]
    return model, example_input, partial(loss_fn, tokens=example_input) if net.loss == "next_token" else loss_fn


def structure(name: str, model: nn.Module, **options) -> dict[str, list[str]]:
    """What the zoo knows of net ``name``'s layout beyond its graph: its ``blocks`` and its ``sequence``."""
    net = spec(name, **options)
    return {"blocks": net.blocks(model), "sequence": net.sequence(model)}


def check_sizes(name: str, batch_size: int, image_size: int, **options) -> None:
    """Raise ``ValueError`` saying what is valid when net ``name`` cannot take these sizes."""
    _check_sizes(spec(name, **options), name, batch_size, image_size)


def _check_sizes(net: NetSpec, name: str, batch_size: int, image_size: int) -> None:
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    if not net.valid_side(image_size):
        what = "a sequence length" if net.input == "tokens" else "an image side"
        raise ValueError(f"{name} needs {what} that is {net.side_rule}; got {image_size}")


