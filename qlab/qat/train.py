"""Quantization-aware fine-tuning of the shipped TinyLM, and the shipped QAT checkpoints.

    python -m qlab.qat.train --weights int3 --group 64              -> qlab/qat/w3g64.pt
    python -m qlab.qat.train --weights int4 --group 64 --acts int4  -> qlab/qat/w4g64a4.pt
    python -m qlab.qat.train --weights int2 --steps 20 --out /tmp/x.pt   (a smoke run)

Starts from qlab/lm/tinylm.pt, puts the quantizers in (prepare_qat: LSQ steps for the
weights, started from qlab's absmax scales; activations per token, dynamic, exactly as
qlab.lm.quality quantizes them at evaluation) and fine-tunes EVERY parameter on windows of
the training split. The loss is distillation from the float model it started from
(--loss kd, the default): KL(float || quantized) of every next-byte prediction, the
quantity notebook 07 measures, so the run learns to BE the float model at low precision
instead of training it further. (With --loss ce, the next-byte cross-entropy, the effect of
extra training on the data and the recovery from quantization are mixed up in the
results.) Google's QAT of Gemma 3 also took the float checkpoint's probabilities as
targets. The rest is TinyLM's own recipe (qlab.lm.train: batches of 16 x 256 bytes, AdamW,
its warm-up + cosine shape of learning rate, grad clip 1.0) at a fine-tuning learning
rate, the LSQ steps with their own. Then it converts, evaluates on all 382 validation
windows and writes the QTensor checkpoint (qlab.qat.checkpoint) and a log of every step.

Reproducible like qlab.lm.train: seeded window order (a torch.Generator of its own),
deterministic algorithms, a fixed number of steps; the same CPU, torch build and thread
count give the same bytes (tests/qat replays the first logged losses of every shipped run,
within the last float bits another CPU changes).
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from qlab._tensor import torch_threads
from qlab.lm.data import load_splits, random_batch
from qlab.lm.model import TinyLM, load_checkpoint
from qlab.lm.train import BATCH_SIZE, BLOCK_SIZE, CHECKPOINT, PEAK_LR, evaluate, lr_at
from qlab.qat.checkpoint import load_quantized, save_quantized
from qlab.qat.lsq import LSQQuantizer
from qlab.qat.modules import convert, prepare_qat

HERE = Path(__file__).parent
SEED = 4321  # the window order of QAT runs (TinyLM's own run used 1234)


@dataclass(frozen=True)
class Recipe:
    """One QAT run. Learning rates are peaks of TinyLM's schedule shape (lr_factor)."""

    weights: str = "int4"  # weight scheme (LSQ steps for int2..int8)
    group: int | str = 64  # weight group size, or "channel"
    acts: str | None = None  # activation scheme, one dynamic scale per token; None: float
    steps: int = 200
    batch_size: int = BATCH_SIZE  # 16 windows ...
    block_size: int = BLOCK_SIZE  # ... of 256 bytes per step
    weight_lr: float = 5e-4  # the float parameters (TinyLM was trained at 2e-3)
    # Each layer's LSQ steps: relative to their mean initial size, since Adam moves a
    # parameter by up to ~lr per step and int2 steps are ~10x int4 steps.
    scale_lr: float = 2e-2
    loss: str = "kd"  # "kd": KL(float || QAT) per next byte; "ce": next-byte cross-entropy

    @property
    def name(self) -> str:
        """File stem: int3 / 64 / None -> 'w3g64'; int4 / 64 / int4 -> 'w4g64a4'."""
        g = "ch" if self.group == "channel" else f"g{self.group}"
        a = "" if self.acts is None else "a" + self.acts.removeprefix("int")
        return f"w{self.weights.removeprefix('int')}{g}{a}"


# The shipped runs (notebook 14), by file stem.
RUNS = {r.name: r for r in (Recipe(weights="int4"), Recipe(weights="int3"),
                            Recipe(weights="int2"), Recipe(weights="int4", acts="int4"))}


def lr_factor(step: int, steps: int) -> float:
    """TinyLM's schedule (qlab.lm.train.lr_at: linear warm-up, cosine to 10 %) relative to
    its peak, stretched to any run length as if the run had 300 steps."""
    return lr_at(step * 300 // steps, 300) / PEAK_LR


def load_run(name: str) -> tuple[TinyLM, dict]:
    """A shipped QAT run (a key of RUNS): the converted TinyLM and what its run recorded."""
    if name not in RUNS:
        raise KeyError(f"no shipped run {name!r}; choose from {sorted(RUNS)}")
    return load_quantized(HERE / f"{name}.pt")


def _param_groups(model: torch.nn.Module, recipe: Recipe) -> list[dict]:
    """AdamW groups: the float parameters at weight_lr; each LSQ quantizer's steps at
    scale_lr times their mean initial size, without weight decay."""
    quantizers = [m for m in model.modules() if isinstance(m, LSQQuantizer)]
    ids = {id(q.scale) for q in quantizers}
    groups = [{"params": [p for p in model.parameters() if id(p) not in ids],
               "peak": recipe.weight_lr}]
    for q in quantizers:
        size = float(q.scale.detach().abs().mean())
        groups.append({"params": [q.scale], "peak": recipe.scale_lr * size})
    for g in groups:
        g["lr"], g["weight_decay"] = g["peak"], 0.0  # fine-tuning: no pull towards 0
    return groups


def _loss(recipe: Recipe, logits: torch.Tensor, y: torch.Tensor, teacher: TinyLM,
          x: torch.Tensor) -> torch.Tensor:
    if recipe.loss == "ce":
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())
    with torch.no_grad():
        target = F.log_softmax(teacher(x).flatten(0, 1), dim=-1)
    # mean over next-byte predictions of KL(float || QAT), in nats
    return F.kl_div(F.log_softmax(logits.flatten(0, 1), dim=-1), target, log_target=True,
                    reduction="batchmean")


def train_qat(recipe: Recipe | None = None, threads: int = 1, base: TinyLM | None = None,
              progress: bool = True, log=None, max_steps: int | None = None):
    """Fine-tune TinyLM (``base``, default the shipped checkpoint; it stays untouched and
    is the distillation teacher) with quantizers in the loop. Returns (qat_model, history
    [(step, loss)], meta). ``log``: an open text file, one line per step. ``max_steps``:
    stop early, at the learning rates of the full run (tests replay a run's start so).
    Sets torch's thread count and deterministic mode for the run, then restores both."""
    recipe = recipe or Recipe()
    if recipe.loss not in ("kd", "ce"):
        raise ValueError(f"loss must be 'kd' or 'ce', got {recipe.loss!r}")
    with torch_threads(threads, deterministic=True):
        base = (load_checkpoint(CHECKPOINT)[0] if base is None else base).eval()
        qat = prepare_qat(base, recipe.weights, recipe.group, act_scheme=recipe.acts)
        opt = torch.optim.AdamW(_param_groups(qat, recipe), betas=(0.9, 0.95))
        return _loop(qat, base, opt, recipe, progress, log, max_steps)


def _loop(qat, teacher, opt, recipe: Recipe, progress, log, max_steps):
    train_data, _ = load_splits()
    gen = torch.Generator().manual_seed(SEED)
    qat.train()
    history = []
    t0 = time.time()
    n = recipe.steps if max_steps is None else min(recipe.steps, max_steps)
    bar = tqdm(range(n), desc=f"QAT {recipe.name}", disable=not progress, mininterval=1.0)
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = group["peak"] * lr_factor(step, recipe.steps)
        x, y = random_batch(train_data, recipe.batch_size, recipe.block_size, gen)
        loss = _loss(recipe, qat(x), y, teacher, x)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(qat.parameters(), 1.0)
        opt.step()
        history.append((step, loss.item()))
        bar.set_postfix(loss=f"{loss.item():.4f}")
        if log is not None:
            log.write(f"step {step:4d}  loss {loss.item():.4f}  {time.time() - t0:7.1f}s\n")
            log.flush()
    qat.eval()
    last = [loss for _, loss in history[-50:]]
    meta = {**asdict(recipe), "seed": SEED, "loss_last50": sum(last) / max(len(last), 1),
            "train_seconds": round(time.time() - t0, 1), "threads": torch.get_num_threads(),
            "torch": str(torch.__version__)}
    return qat, history, meta


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", default="int4", help="weight scheme, e.g. int4, int3, int2")
    ap.add_argument("--group", default="64", help="group size, or 'channel'")
    ap.add_argument("--acts", default=None, help="activation scheme per token, e.g. int4")
    ap.add_argument("--steps", type=int, default=Recipe.steps)
    ap.add_argument("--loss", default=Recipe.loss, choices=("kd", "ce"))
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: on a shared CPU, 2 threads ran 4x slower)")
    ap.add_argument("--val-windows", type=int, default=None, help="default: all 382")
    ap.add_argument("--out", type=Path, default=None, help="default qlab/qat/<run name>.pt")
    args = ap.parse_args(argv)
    group = args.group if args.group == "channel" else int(args.group)
    recipe = Recipe(weights=args.weights, group=group, acts=args.acts, steps=args.steps,
                    loss=args.loss)
    out = args.out or HERE / f"{recipe.name}.pt"
    log_path = out.with_name(out.stem + "_log.txt")
    val = load_splits()[1]
    n_val = args.val_windows or len(val) // (BLOCK_SIZE + 1)
    with open(log_path, "w") as log:
        log.write(f"python -m qlab.qat.train --weights {args.weights} --group {args.group}"
                  f"{'' if args.acts is None else ' --acts ' + args.acts} --steps {args.steps}"
                  f" --loss {args.loss} --threads {args.threads}\n")
        qat, _, meta = train_qat(recipe, args.threads, log=log)
        model = convert(qat)
        val_loss = evaluate(model, val, n_val, BLOCK_SIZE)
        meta.update(val_loss=val_loss, val_ppl=math.exp(val_loss), val_windows=n_val)
        summary = ", ".join(f"{k}={v}" for k, v in meta.items())
        log.write(summary + "\n")
    save_quantized(model.eval(), out, **meta)
    print(f"{summary}\nsaved {out} and {log_path}")


if __name__ == "__main__":
    main()
