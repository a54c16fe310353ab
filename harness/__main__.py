"""``python -m harness +net=NAME +strategy=NAME``: one measurement, composed from ``configs/`` by Hydra."""

from __future__ import annotations

import hydra
from omegaconf import DictConfig, OmegaConf

from harness import nets
from harness.run import run_cell
import strategies


@hydra.main(version_base="1.3", config_path="../configs", config_name="config")
def main(cfg: DictConfig) -> None:
    if "net" not in cfg:
        raise SystemExit(f"choose a net with +net=NAME; valid nets: {', '.join(nets.available())}")
    if "strategy" not in cfg:
        raise SystemExit(f"choose a strategy with +strategy=NAME; valid strategies: {', '.join(strategies.available())}")
    run_cell(cfg.net.name, cfg.strategy.name, batch_size=cfg.batch_size, image_size=cfg.image_size,
             device=cfg.device.name, budget=cfg.budget, cost_model=cfg.cost_model,
             options=OmegaConf.to_container(cfg.strategy.options, resolve=True), warmup_steps=cfg.device.warmup_steps,
             timed_steps=cfg.device.timed_steps, results_dir=cfg.results_dir, resume=cfg.resume)


if __name__ == "__main__":
    main()
