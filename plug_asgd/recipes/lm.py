"""Language-model recipe: a small GPT-style byte-level transformer on Debian's fortune cookies.

The model reads bytes (a vocabulary of 256, no tokenizer) and predicts each next byte: token and position
embeddings, pre-LayerNorm blocks of causal self-attention (torch's ``scaled_dot_product_attention``) and an MLP,
and an output head tied to the token embedding. Its default size (``--d-model 192 --layers 4 --heads 6``, 1.8M
parameters) trains on two CPU cores. The corpus, its split by document and its windows are in
:mod:`plug_asgd.recipes.lm_data`.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from typing_extensions import override

from plug_asgd.recipes.data import DEFAULT_LR, OPTIMIZERS, add_common_data_arguments
from plug_asgd.recipes.lm_data import FORTUNES_DIR, PACKAGE, CorpusNotFoundError, FortunesDataModule

__all__ = [
    "VOCAB",
    "Block",
    "ByteGPT",
    "CorpusNotFoundError",
    "FortunesDataModule",
    "add_data_arguments",
    "check_context",
]

VOCAB = 256  # bytes


class Block(nn.Module):
    """One pre-LayerNorm transformer block: ``x + attention(ln(x))``, then ``x + mlp(ln(x))``.

    Args:
        d_model: the width of the residual stream.
        heads: the attention heads; ``d_model`` divided among them.
        dropout: dropout on the attention weights and after each branch.
    """

    def __init__(self, d_model: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.dropout = dropout
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))
        self.drop = nn.Dropout(dropout)

    @override
    def forward(self, x: Tensor) -> Tensor:
        """The block applied to ``x`` [B, T, d_model]; position ``t`` sees positions ``0..t`` only."""
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                  dropout_p=self.dropout if self.training else 0.0)
        x = x + self.drop(self.proj(attended.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.mlp(self.ln2(x)))


class ByteGPT(pl.LightningModule):
    """A GPT-style causal transformer over bytes, trained to predict each next byte, as a LightningModule.

    ``forward`` gives logits ``[B, 256, T]``, the class dimension second as ``F.cross_entropy`` takes a sequence's
    (so the :class:`~plug_asgd.callbacks.Supervisor`'s default evaluation, the recipes' ``(x, y)`` batches and
    ``argmax(dim=1)`` all work as for a classifier). Validation and test log the mean loss per byte
    (``val_loss``, nats), its perplexity ``exp(val_loss)`` (``val_ppl``) and the share of bytes predicted
    (``val_acc``), over every rank's windows, with ``sync_dist=True``; training logs ``train_loss``. The optimizer
    is AdamW (weight decay on the matrices and embeddings only) with a linear warmup and a cosine decay to a tenth
    of the rate where the run's length is known, or SGD with momentum (Nesterov's or not).

    Args:
        d_model: the width of the residual stream.
        layers: the transformer blocks.
        heads: the attention heads per block; they divide ``d_model``.
        max_context: the longest input the model reads: the length of its position table.
        dropout: dropout in the blocks and on the embeddings (0: none).
        lr: the peak learning rate; None: the optimizer's in :data:`plug_asgd.recipes.data.DEFAULT_LR`.
        optimizer: ``"adam"`` (AdamW), ``"sgd"`` or ``"nesterov"``.
        momentum: SGD's momentum (unused by AdamW).
        weight_decay: AdamW's decoupled weight decay on the matrices and embeddings.
        warmup_steps: optimizer steps of linear warmup from 0 to ``lr`` (0: none).

    Raises:
        ValueError: where a size is not positive, ``heads`` does not divide ``d_model``, or ``optimizer`` is not one
            of :data:`plug_asgd.recipes.data.OPTIMIZERS`.
    """

    def __init__(self, d_model: int = 192, layers: int = 4, heads: int = 6, max_context: int = 128,
                 dropout: float = 0.0, lr: float | None = None, optimizer: str = "adam", momentum: float = 0.9,
                 weight_decay: float = 0.1, warmup_steps: int = 100) -> None:
        super().__init__()
        sizes = {"d_model": d_model, "layers": layers, "heads": heads, "max_context": max_context}
        for name, value in sizes.items():
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if d_model % heads:
            raise ValueError(f"heads ({heads}) must divide d_model ({d_model})")
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {optimizer!r}")
        self.save_hyperparameters()
        self.tok_emb = nn.Embedding(VOCAB, d_model)
        self.pos_emb = nn.Embedding(max_context, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d_model, heads, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, VOCAB, bias=False)
        self.apply(self._init_weights)
        for block in self.blocks:  # GPT-2's: each residual branch's last layer scaled by the depth
            for last in (block.proj, block.mlp[2]):
                nn.init.normal_(last.weight, std=0.02 / math.sqrt(2 * layers))
        self.head.weight = self.tok_emb.weight  # tied, after the initialisation: the embedding's N(0, 0.02)
        self._sums: dict[str, Tensor] = {}

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    @property
    def max_context(self) -> int:
        """The longest input the model reads (its position table's length)."""
        return self.pos_emb.num_embeddings

    @override
    def forward(self, x: Tensor) -> Tensor:
        """Next-byte logits ``[B, 256, T]`` for bytes ``x`` ``[B, T]`` (int64, ``T`` at most ``max_context``).

        Raises:
            ValueError: where ``T`` exceeds :attr:`max_context`.
        """
        t = x.shape[-1]
        if t > self.max_context:
            raise ValueError(f"an input of {t} bytes is longer than the model's maximum context of "
                             f"{self.max_context} (max_context)")
        h = self.drop(self.tok_emb(x) + self.pos_emb(torch.arange(t, device=x.device)))
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln_f(h)).transpose(1, 2)

    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, sync_dist=True, prog_bar=True)
        return loss

    def _eval_step(self, batch: tuple[Tensor, Tensor], prefix: str) -> None:
        x, y = batch
        logits = self(x)
        sums = torch.stack([F.cross_entropy(logits, y, reduction="sum").float(),
                            (logits.argmax(dim=1) == y).sum().float(), y.new_tensor(y.numel(), dtype=torch.float32)])
        self._sums[prefix] = self._sums.get(prefix, torch.zeros_like(sums)) + sums

    def _eval_epoch_end(self, prefix: str) -> None:
        """Log the mean loss per byte, its perplexity and the accuracy over every rank's windows."""
        local = self._sums.pop(prefix, None)
        if local is None:
            local = torch.zeros(3, device=self.device)
        total = self.trainer.strategy.reduce(local, reduce_op="sum")
        loss = total[0] / total[2].clamp(min=1)
        self.log(f"{prefix}_loss", loss, sync_dist=True, prog_bar=True)
        self.log(f"{prefix}_ppl", torch.exp(loss), sync_dist=True, prog_bar=True)
        self.log(f"{prefix}_acc", total[1] / total[2].clamp(min=1), sync_dist=True)

    @override
    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._eval_step(batch, "val")

    @override
    def on_validation_epoch_end(self) -> None:
        self._eval_epoch_end("val")

    @override
    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._eval_step(batch, "test")

    @override
    def on_test_epoch_end(self) -> None:
        self._eval_epoch_end("test")

    @override
    def configure_optimizers(self) -> dict[str, Any]:
        """AdamW or SGD, stepped per optimizer step by the warmup and cosine schedule of :meth:`lr_factor`."""
        hp = self.hparams
        lr = DEFAULT_LR[hp.optimizer] if hp.lr is None else hp.lr
        if hp.optimizer == "adam":
            params = [p for p in self.parameters() if p.requires_grad]
            groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": hp.weight_decay},
                      {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
            optimizer: torch.optim.Optimizer = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.99))
        else:
            optimizer = torch.optim.SGD(self.parameters(), lr=lr, momentum=hp.momentum,
                                        nesterov=hp.optimizer == "nesterov")
        total = self.trainer.estimated_stepping_batches if self._trainer is not None else math.inf
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: self.lr_factor(step, total))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def lr_factor(self, step: int, total: float) -> float:
        """The share of the peak rate at optimizer step ``step``: a linear warmup over ``warmup_steps``, then a
        cosine from 1 down to 0.1 at step ``total`` (constant 1 where ``total`` is infinite).

        Args:
            step: the optimizer steps taken so far.
            total: the run's optimizer steps (``Trainer.estimated_stepping_batches``), or ``math.inf``.
        """
        warmup = self.hparams.warmup_steps
        if step < warmup:
            return (step + 1) / warmup
        if not math.isfinite(total) or total <= warmup:
            return 1.0
        progress = min(1.0, (step - warmup) / (total - warmup))
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))


def check_context(context: int, max_context: int | None) -> int:
    """The model's maximum context for windows of ``context`` bytes: ``max_context``, or ``context`` where None.

    Args:
        context: the windows' input length (``--context``).
        max_context: the model's position table (``--max-context``); None: ``context``.

    Raises:
        ValueError: where ``context`` is below 1, or longer than ``max_context``.
    """
    if context < 1:
        raise ValueError(f"--context must be at least 1 byte, got {context}")
    if max_context is not None and context > max_context:
        raise ValueError(f"--context {context} is longer than the model's maximum context of {max_context} bytes "
                         f"(--max-context): pass --context {max_context} or less, or a larger --max-context")
    return context if max_context is None else max_context


def add_data_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The recipe's corpus, model and optimiser flags, beside the batch and optimizer flags every recipe has.

    Args:
        parser: the parser the flags are added to, and which is returned.
    """
    default_dir = Path(os.environ.get("PLUG_ASGD_FORTUNES") or FORTUNES_DIR).expanduser()
    parser.add_argument("--data-dir", type=Path, default=default_dir,
                        help=f"folder holding the corpus, Debian's {PACKAGE!r} package "
                             "(default: $PLUG_ASGD_FORTUNES or %(default)s)")
    parser.add_argument("--context", type=int, default=128, help="bytes the model reads per window "
                                                                 "(default: %(default)s)")
    parser.add_argument("--max-context", type=int, default=None,
                        help="the model's position table, the longest context it can read (default: --context)")
    parser.add_argument("--d-model", type=int, default=192, help="model width (default: %(default)s)")
    parser.add_argument("--layers", type=int, default=4, help="transformer blocks (default: %(default)s)")
    parser.add_argument("--heads", type=int, default=6, help="attention heads, dividing --d-model "
                                                             "(default: %(default)s)")
    parser.add_argument("--dropout", type=float, default=0.0, help="dropout (default: %(default)s)")
    parser.add_argument("--weight-decay", type=float, default=0.1, help="AdamW's (default: %(default)s)")
    parser.add_argument("--warmup-steps", type=int, default=100,
                        help="optimizer steps of linear learning-rate warmup (default: %(default)s)")
    add_common_data_arguments(parser)
    for action in parser._actions:  # the shared flags' help, in this recipe's units: windows, not images
        if action.dest == "train_subset":
            action.help = "training windows per epoch (default: the training bytes / --context)"
        elif action.dest == "test_subset":
            action.help = "validate and test on this many windows, spread over the held-out documents (default: all)"
        elif action.dest == "no_download":
            action.help = "accepted for the recipes' common flags: the corpus is never downloaded"
        elif action.dest == "optimizer":
            action.help = "optimiser: adam is AdamW (default: %(default)s)"
    return parser


def build_parser() -> argparse.ArgumentParser:
    """The recipe's command line: its corpus, model and optimiser flags and the strategy's."""
    from plug_asgd.recipes.common import add_strategy_arguments

    prog = "plug-asgd train lm" if Path(sys.argv[0]).name == "plug-asgd" else None
    parser = argparse.ArgumentParser(prog=prog, description="Train a byte-level GPT on Debian's fortune cookies "
                                                            "under AsyncPSStrategy and test the central model on "
                                                            "held-out fortunes.")
    return add_strategy_arguments(add_data_arguments(parser))


def build(args: argparse.Namespace) -> tuple[ByteGPT, FortunesDataModule]:
    """The model and the data module the parsed flags ask for.

    Args:
        args: the parsed command line of :func:`build_parser`.

    Raises:
        ValueError: where ``--context`` is longer than the model's maximum context, or a size is refused.
    """
    max_context = check_context(args.context, args.max_context)
    model = ByteGPT(d_model=args.d_model, layers=args.layers, heads=args.heads, max_context=max_context,
                    dropout=args.dropout, lr=args.lr, optimizer=args.optimizer, weight_decay=args.weight_decay,
                    warmup_steps=args.warmup_steps)
    datamodule = FortunesDataModule(args.data_dir, context=args.context, batch_size=args.batch_size,
                                    train_windows=args.train_subset, val_windows=args.test_subset, seed=args.seed)
    return model, datamodule


def main(argv: list[str] | None = None) -> dict | None:
    """Entry point of ``recipes/lm.py`` and ``plug-asgd train lm``.

    Args:
        argv: the command line's arguments, without the program's name; None: ``sys.argv``'s.

    Returns:
        The run's summary (test loss and perplexity, PS counters, bytes, times) on global rank 0; None on the other
        ranks.

    Raises:
        SystemExit: where a flag is refused (a context longer than the model's, a size): the error, before any
            worker starts.
    """
    from plug_asgd.recipes.common import seed_everything, train_and_test

    args = build_parser().parse_args(argv)
    seed_everything(args.seed)  # before the model is built: its initialization is the run's (rank 0's) start
    try:
        model, datamodule = build(args)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    return train_and_test("lm", model, datamodule, args)
