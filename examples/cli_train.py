"""Configure ``LayerHealthCallback`` from YAML with ``LightningCLI``.

Run from the repository root (needs ``pip install -e ".[cli]"``, which brings ``jsonargparse[signatures]``):

    python examples/cli_train.py fit --config examples/cli_config.yaml

Every ``init_args`` entry of the callback in ``cli_config.yaml`` can be overridden on the command line, e.g.
``--trainer.callbacks.init_args.every_n_steps 5`` when the callback is the only one, and
``python examples/cli_train.py fit --config examples/cli_config.yaml --print_config`` shows the full configuration.
The data module's sizes are linked to the model's, so ``--data.in_features 16`` changes both. A value the callback
rejects ends the command with one ``error:`` line naming where it is (``HealthCLI.before_instantiate_classes``).
"""

from __future__ import annotations

import importlib
from pathlib import Path

import lightning.pytorch as pl
import torch
from _common import command
from jsonargparse import Namespace
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hookdiag import LayerHealthCallback


class SyntheticClassifier(pl.LightningModule):
    """A small MLP classifier: ``encoder`` (Linear, ReLU, LayerNorm, Linear, ReLU) followed by a linear ``head``.

    Args:
        in_features: Size of each input vector.
        hidden: Width of the hidden layers.
        num_classes: Number of output classes.
        lr: SGD learning rate.
    """

    def __init__(self, in_features: int = 8, hidden: int = 32, num_classes: int = 3, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.lr = lr
        self.encoder = nn.Sequential(
            nn.Linear(in_features, hidden),
            nn.ReLU(),
            nn.LayerNorm(hidden),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
        )
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Class logits for a batch of inputs."""
        return self.head(self.encoder(x))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """Cross-entropy loss of one batch."""
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """Plain SGD."""
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class SyntheticDataModule(pl.LightningDataModule):
    """Gaussian inputs labelled by a fixed random linear map: a learnable task that needs no download.

    Args:
        num_samples: Number of training samples.
        in_features: Size of each input vector.
        num_classes: Number of classes.
        batch_size: Samples per batch.
        seed: Seed of the generator that draws the data.
    """

    def __init__(
        self, num_samples: int = 256, in_features: int = 8, num_classes: int = 3, batch_size: int = 32, seed: int = 0
    ) -> None:
        super().__init__()
        self.num_samples = num_samples
        self.in_features = in_features
        self.num_classes = num_classes
        self.batch_size = batch_size
        self.seed = seed
        self.train_set: TensorDataset | None = None

    def setup(self, stage: str) -> None:
        """Draw the data set (deterministic for a given seed)."""
        g = torch.Generator().manual_seed(self.seed)
        x = torch.randn(self.num_samples, self.in_features, generator=g)
        w = torch.randn(self.in_features, self.num_classes, generator=g)
        self.train_set = TensorDataset(x, (x @ w).argmax(dim=1))

    def train_dataloader(self) -> DataLoader:
        """Shuffled training batches."""
        assert self.train_set is not None
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)


class HealthCLI(LightningCLI):
    """``LightningCLI`` that keeps the model's sizes in step with the data module's, and reports a bad callback value.

    LightningCLI instantiates the Trainer's callbacks after parsing, through jsonargparse, which turns a
    constructor's ``ValueError`` into a traceback ending in a list of every type of ``trainer.callbacks`` it tried.
    Building each ``LayerHealthCallback`` once before that turns it into a parser error: usage, then one line.
    """

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        """Link ``data.in_features``/``data.num_classes`` to the model's arguments of the same names."""
        parser.link_arguments("data.in_features", "model.in_features")
        parser.link_arguments("data.num_classes", "model.num_classes")

    def before_instantiate_classes(self) -> None:
        """Check each ``LayerHealthCallback`` of ``trainer.callbacks``; exit with one line naming a rejected value."""
        config = self.config.get(str(self.subcommand), self.config) if self.subcommand else self.config
        callbacks = config.get("trainer.callbacks") or []
        for i, entry in enumerate(callbacks if isinstance(callbacks, list) else [callbacks]):
            cls = _class_of(entry)
            if not (isinstance(cls, type) and issubclass(cls, LayerHealthCallback)):
                continue
            init_args = entry.get("init_args")
            try:
                cls(**(init_args.as_dict() if isinstance(init_args, Namespace) else {}))
            except ValueError as error:
                self.parser.error(f"trainer.callbacks[{i}].init_args: {error}")


def _class_of(entry: object) -> object:
    """The class a ``class_path`` entry names (``None`` when it is no such entry or does not import)."""
    path = entry.get("class_path") if isinstance(entry, Namespace) else None
    module, _, name = path.rpartition(".") if isinstance(path, str) else ("", "", "")
    try:
        return getattr(importlib.import_module(module), name) if module else None
    except (ImportError, AttributeError):
        return None


def main(args: list[str] | None = None) -> HealthCLI:
    """Parse the command line (or ``args``) and run the requested subcommand.

    Args:
        args: Arguments instead of ``sys.argv[1:]``, e.g. ``["fit", "--config", "examples/cli_config.yaml"]``.

    Returns:
        The CLI object, which holds the ``trainer`` and ``model``.
    """
    cli = HealthCLI(SyntheticClassifier, SyntheticDataModule, args=args)
    print_report_command(cli.trainer)
    return cli


def print_report_command(trainer: pl.Trainer) -> None:
    """Print where each logger wrote and the ``hookdiag report`` command that draws the run (rank zero only)."""
    if not trainer.is_global_zero:
        return
    report = command("hookdiag", "lightning_hookdiag")
    for logger in trainer.loggers:
        log_dir = getattr(logger, "log_dir", None)  # where the logger writes files, for the file-based ones
        if not isinstance(log_dir, str):
            continue
        run_dir = Path(log_dir).resolve()
        print(f"{type(logger).__name__} logs: {run_dir}")
        print(f"  {report} report {run_dir} --stat act_grad_norm")


if __name__ == "__main__":
    main()
