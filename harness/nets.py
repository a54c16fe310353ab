"""The model zoo: the seven networks of seed 004's Table 1, at its input and batch sizes.

``build(name, batch_size=None, image_size=None, device="meta") -> (model, example_input, loss_fn)``.
Models are built in training mode; on ``meta`` nothing is allocated. Choices where the paper's Chainer
models cannot be had exactly:
- ``pspnet``: segmentation-models-pytorch's PSPNet on a dilated ResNet-101 (all five encoder stages,
  output stride 8, the ChainerCV layout), 19 classes (Cityscapes, the dataset of the 713x713 crop).
  smp needs sides divisible by the output stride 8, so the input is 712x712, the nearest to 713.
- ``unet``: the original U-Net of Ronneberger et al. (unpadded 3x3 convolutions, crop and concatenate),
  572x572 input, 2 classes, written here: it is the network the paper ran, 388x388 output.
- ``resnet50``, ``resnet152``, ``vgg19``, ``densenet161``, ``googlenet``: torchvision at 224x224, 1000
  classes; GoogLeNet without its auxiliary classifiers (torchvision's has batch norm after every conv).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class NetSpec:
    build_model: Callable[[], nn.Module]
    batch_size: int  # seed 004, Table 1
    image_size: int
    paper_nodes: int  # #V of seed 004, Table 1
    paper_vanilla_gb: float  # vanilla peak of seed 004, Table 1 (Chainer, K40c, parameters included)
    loss: str = "classification"
    valid_side: Callable[[int], bool] = lambda side: side >= 32
    side_rule: str = "at least 32"
    # The natural blocks a careful PyTorch user wraps in torch.utils.checkpoint, as module paths
    # ("layer1.0") or slices of an nn.Sequential's children ("features[0:5]"), in execution order.
    blocks: Callable[[nn.Module], list[str]] = lambda model: []
    # The net as a chain for checkpoint_sequential: module paths and functional steps (``FUNCTIONAL``) that,
    # applied in turn, compute what ``forward`` does; empty where no chain exists (U-Net's long skips).
    sequence: Callable[[nn.Module], list[str]] = lambda model: []


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
}


def available() -> list[str]:
    return sorted(NETS)


def spec(name: str) -> NetSpec:
    if name not in NETS:
        raise KeyError(f"unknown net {name!r}; valid nets: {', '.join(available())}")
    return NETS[name]


def build(name: str, batch_size: int | None = None, image_size: int | None = None, device: str = "meta"):
    """``(model, example_input, loss_fn)`` for net ``name``; sizes default to seed 004's."""
    net = spec(name)
    batch_size = net.batch_size if batch_size is None else batch_size
    image_size = net.image_size if image_size is None else image_size
    check_sizes(name, batch_size, image_size)
    with torch.device(device):
        model = net.build_model()
    model.train()
    example_input = torch.randn(batch_size, 3, image_size, image_size, device=device)
    return model, example_input, LOSSES[net.loss]


def structure(name: str, model: nn.Module) -> dict[str, list[str]]:
    """What the zoo knows of net ``name``'s layout beyond its graph: its ``blocks`` and its ``sequence``."""
    net = spec(name)
    return {"blocks": net.blocks(model), "sequence": net.sequence(model)}


def check_sizes(name: str, batch_size: int, image_size: int) -> None:
    """Raise ``ValueError`` saying what is valid when net ``name`` cannot take these sizes."""
    net = spec(name)
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    if not net.valid_side(image_size):
        raise ValueError(f"{name} needs an image side that is {net.side_rule}; got {image_size}")


def classification_loss(output: torch.Tensor) -> torch.Tensor:
    """Cross-entropy against fixed labels (class ``i % classes`` for sample ``i``)."""
    labels = torch.arange(output.shape[0], device=output.device) % output.shape[1]
    return F.cross_entropy(output, labels)


def segmentation_loss(output: torch.Tensor) -> torch.Tensor:
    """Per-pixel cross-entropy against a fixed label map (class 0 everywhere)."""
    labels = torch.zeros(output.shape[0], *output.shape[2:], dtype=torch.long, device=output.device)
    return F.cross_entropy(output, labels)


LOSSES = {"classification": classification_loss, "segmentation": segmentation_loss}
