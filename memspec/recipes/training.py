"""The training harness the torch recipes share (distill, head): torch seeded on the build's
threads, the held-out split, the batch order, AdamW with warm-up and cosine, and a loop that
checkpoints every `ckpt_every` steps and resumes from the last checkpoint.

Deterministic for a seed and thread count: the batch at step s comes from the seed, torch is
seeded, and a resumed run continues with the optimiser and schedule state it stopped with.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from memspec.recipes import corpus

HELDOUT_EVERY = 10  # every 10th sequence is held out to measure agreement


def seeded_torch(recipe_name: str, seed: int) -> tuple[Any, int]:
    """(torch, threads): torch seeded and set to the build's threads (MEMSPEC_BUILD_THREADS);
    a RuntimeError naming the extra when torch is not installed."""
    try:
        import torch
    except ImportError as e:
        raise RuntimeError(
            f"recipe '{recipe_name}' needs torch: pip install 'memspec[torch]'"
        ) from e
    threads = corpus.default_threads()
    torch.manual_seed(seed)
    torch.set_num_threads(threads)
    return torch, threads


def heldout_split(n: int, eval_seqs: int) -> tuple[list[int], list[int]]:
    """(held-out, training) indices of n sequences: every HELDOUT_EVERY-th, up to eval_seqs."""
    held = [i for i in range(n) if i % HELDOUT_EVERY == 0][:eval_seqs]
    held_set = set(held)
    return held, [i for i in range(n) if i not in held_set]


def batch_order(n_train: int, seed: int, steps: int, batch: int) -> np.ndarray:
    """Training-example indices for every step: seeded epochs of a permutation."""
    rng = np.random.default_rng(seed)
    need = steps * batch
    epochs = [rng.permutation(n_train) for _ in range(math.ceil(need / max(n_train, 1)))]
    return np.concatenate(epochs)[:need].reshape(steps, batch)


def warmup_cosine(opt: Any, steps: int) -> Any:
    """Linear warm-up over the first 5% of `steps`, then a cosine decay to zero."""
    import torch

    warmup = max(1, steps // 20)
    return torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: (
            min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
        ),
    )


def train(
    model: Any,
    recipe: Any,
    ckpt: Path,
    loss_at: Callable[[int], Any],
    desc: str,
    progress: bool = True,
    kept: Callable[[str], bool] = lambda name: True,
) -> list[float]:
    """Train the model's trainable parameters for recipe.steps, `loss_at(step)` giving each
    step's loss; resume from `ckpt` if it is there and write it every recipe.ckpt_every steps
    (only the state entries `kept` names: frozen tables need not be saved). Returns the loss
    of every step, resumed ones included."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=recipe.lr, weight_decay=0.0)
    sched = warmup_cosine(opt, recipe.steps)
    step, losses = 0, []
    if ckpt.is_file():
        state = torch.load(ckpt, weights_only=False)
        model.load_state_dict(state["model"], strict=False)
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        step, losses = state["step"], state["losses"]

    def save() -> None:
        state = {
            "model": {n: t for n, t in model.state_dict().items() if kept(n)},
            "opt": opt.state_dict(),
            "sched": sched.state_dict(),
            "step": step,
            "losses": losses,
        }
        tmp = ckpt.with_suffix(".tmp")
        torch.save(state, tmp)
        tmp.replace(ckpt)  # a kill mid-save leaves the previous checkpoint whole

    model.train()
    bar = tqdm(total=recipe.steps, initial=step, desc=desc, unit="step", disable=not progress)
    with bar:
        while step < recipe.steps:
            loss = loss_at(step)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            step += 1
            losses.append(round(loss.item(), 4))
            bar.set_postfix(loss=f"{np.mean(losses[-20:]):.3f}")
            bar.update(1)
            if step % recipe.ckpt_every == 0 or step == recipe.steps:
                save()
    return losses
