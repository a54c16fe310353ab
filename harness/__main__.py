"""``python -m harness +net=NAME +strategy=NAME``: one measurement, composed from ``configs/`` by Hydra."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from harness.cell import Cell, make_cell
from harness.results import Status, cell_name
from harness.run import run
from harness.zoo import nets
from harness.zoo.models import NotAModel
import strategies


@hydra.main(version_base="1.3", config_path="../configs", config_name="config")
def main(cfg: DictConfig) -> None:
    if cfg.net is None:
        raise SystemExit(f"choose a net with +net=NAME; valid nets: {', '.join(nets.available())}; any other "
                         "model: +net=torchvision net.name=NAME, +net=timm net.name=NAME, +net=hf "
                         "net.name=MODEL_TYPE, +net=module net.target=PACKAGE.MODULE:FACTORY")
    if cfg.strategy is None:
        raise SystemExit(f"choose a strategy with +strategy=NAME; valid strategies: {', '.join(strategies.available())}")
    check_keys(cfg)
    try:
        cell = cell_of(cfg)
    except (ValueError, KeyError) as error:  # bad input, refused before anything is traced
        raise SystemExit(error.args[0] if isinstance(error, KeyError) else str(error)) from None
    try:
        row = run(cell, results_dir=cfg.results_dir, resume=cfg.resume, plan_out=cfg.plan_out)
    except NotAModel as error:  # a factory that returned no module: bad input, no row
        raise SystemExit(str(error)) from None
    if row["status"] == Status.ERROR:  # an Exception, not SystemExit: Hydra runs a sweep's other cells, then fails
        raise CellError(f"{cell_name(row)}: {row['error']}")


def cell_of(cfg: DictConfig) -> Cell:
    """The cell the composed config names (``make_cell`` checks each value)."""
    return make_cell(net_name(cfg.net), cfg.strategy.name, batch_size=cfg.batch_size, image_size=cfg.image_size,
                     device=cfg.device.name, budget=cfg.budget, cost_model=cfg.cost_model.value,
                     options=strategy_options(cfg), warmup_steps=cfg.device.warmup_steps,
                     timed_steps=cfg.device.timed_steps, net_options=net_options(cfg.net), compile=cfg.compile,
                     dtype=None if cfg.dtype is None else cfg.dtype.value, world_size=cfg.world_size,
                     shard=cfg.shard.value, optimizer=cfg.optimizer.value)


class CellError(RuntimeError):
    """A cell whose row is ``error``: the command exits non-zero. In a sweep Hydra runs the other cells, then raises
    the first such error, which names every cell of the sweep that ended in error (read when it is printed)."""

    failed: list[str] = []  # each failed cell of this process, as "ROW FILE: error"

    def __init__(self, failure: str):
        CellError.failed.append(failure)
        super().__init__(failure)

    def __str__(self) -> str:
        if len(self.failed) <= 1:
            return super().__str__()
        return f"{len(self.failed)} cells ended in error:\n" + "\n".join(f"  {failure}" for failure in self.failed)


CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def group_keys(group: str, under: str | None = None) -> list[str]:
    """Every key the configs of ``group`` (``configs/GROUP/*.yaml``) set, at the top or under ``under``."""
    keys = set()
    for path in CONFIGS.glob(f"{group}/*.yaml"):
        config = OmegaConf.load(path)
        node = config.get(under) if under else config
        if isinstance(node, DictConfig):
            keys |= set(node) - {"defaults"}
    return sorted(keys)


def check_keys(cfg: DictConfig) -> None:
    """Refuse, before anything is built, a key under ``net`` or ``strategy`` that nothing reads (a typo such as
    ``+strategy.option.mode=mc`` would run the default silently) and a strategy option its ``Options`` refuses,
    naming the valid ones."""
    def refuse(kind: str, unknown: list[str], valid) -> None:
        if unknown:
            raise SystemExit(f"unknown key {kind}.{unknown[0]}; valid keys there: {', '.join(valid) or 'none'}")

    for kind, node in (("strategy", cfg.strategy), ("net", cfg.net)):
        valid = group_keys(kind)
        refuse(kind, sorted(set(node) - set(valid)), valid)
    if isinstance(cfg.net.get("options"), DictConfig):
        valid = group_keys("net", "options")
        refuse("net.options", sorted(set(cfg.net.options) - set(valid)), valid)
    try:
        module = strategies.module(cfg.strategy.name)
    except KeyError as error:
        raise SystemExit(error.args[0]) from None
    options = strategy_options(cfg)
    valid = [field.name for field in dataclasses.fields(module.Options)]
    if "mode" in options and "mode" not in valid:
        raise SystemExit(f"strategy.options.mode: {strategies.no_memory_mode(cfg.strategy.name)}")
    refuse("strategy.options", sorted(set(options) - set(valid)), valid)
    try:
        module.Options(**options)
    except (TypeError, ValueError) as error:
        raise SystemExit(f"strategy.options: {error}") from None


def strategy_options(cfg: DictConfig) -> dict:
    options = cfg.strategy.get("options")
    return {} if options is None else OmegaConf.to_container(options, resolve=True)


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
