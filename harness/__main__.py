"""``python -m harness +net=NAME +strategy=NAME``: one measurement, composed from ``configs/`` by Hydra."""

from __future__ import annotations

import hydra
from omegaconf import DictConfig, OmegaConf

from harness import nets
from harness.run import run_cell
import strategies


@hydra.main(version_base="1.3", config_path="../configs", config_name="config")
def main(cfg: DictConfig) -> None:
    if cfg.net is None:
        raise SystemExit(f"choose a net with +net=NAME; valid nets: {', '.join(nets.available())}; any other "
                         "model: +net=torchvision net.name=NAME, +net=timm net.name=NAME, +net=hf "
                         "net.name=MODEL_TYPE, +net=module net.target=PACKAGE.MODULE:FACTORY")
    if cfg.strategy is None:
        raise SystemExit(f"choose a strategy with +strategy=NAME; valid strategies: {', '.join(strategies.available())}")
    run_cell(net_name(cfg.net), cfg.strategy.name, batch_size=cfg.batch_size, image_size=cfg.image_size,
             device=cfg.device.name, budget=cfg.budget, cost_model=cfg.cost_model.value,
             options=OmegaConf.to_container(cfg.strategy.options, resolve=True), warmup_steps=cfg.device.warmup_steps,
             timed_steps=cfg.device.timed_steps, results_dir=cfg.results_dir, resume=cfg.resume,
             net_options=net_options(cfg.net), compile=cfg.compile,
             dtype=None if cfg.dtype is None else cfg.dtype.value, world_size=cfg.world_size, shard=cfg.shard.value,
             optimizer=cfg.optimizer.value)


def net_name(net: DictConfig) -> str:
    """A zoo net's name, or ``SOURCE:NAME`` for a model of another source (configs/net/{torchvision,timm,
    hf,module}.yaml)."""
    source = net.get("source", "zoo")
    return net.name if source == "zoo" else f"{source}:{net.name}"


def net_options(net: DictConfig) -> dict:
    """The options a source model was given, less those left at their defaults or null (they name the row
    file)."""
    if "options" not in net:
        return {}
    options = OmegaConf.to_container(net.options, resolve=True)
    defaults = {"kwargs": {}, "input": "image", "channels": 3, "vocab_size": None, "loss": None}
    return {key: value for key, value in options.items() if value is not None and defaults.get(key, object()) != value}


if __name__ == "__main__":
    main()
