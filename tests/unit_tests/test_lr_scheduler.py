"""LR schedule values: warmup, WSD stable phase, decay shapes, min LR, and resume."""

import math
from types import SimpleNamespace

import pytest
import torch

from torchtitan.components.lr_scheduler import build_lr_schedulers, lr_factor
from torchtitan.components.optimizer import build_optimizers


def _config(steps=10, warmup=2, decay_ratio=None, decay_type="linear", min_lr_factor=0.0):
    return SimpleNamespace(
        training=SimpleNamespace(steps=steps),
        lr_scheduler=SimpleNamespace(
            warmup_steps=warmup,
            decay_ratio=decay_ratio,
            decay_type=decay_type,
            min_lr_factor=min_lr_factor,
        ),
        optimizer=SimpleNamespace(
            name="AdamW",
            lr=1.0,
            beta1=0.9,
            beta2=0.95,
            eps=1e-8,
            weight_decay=0.0,
            implementation="foreach",
        ),
    )


def _lrs(cfg):
    model = torch.nn.Linear(2, 2)
    opts = build_optimizers([model], cfg)
    sched = build_lr_schedulers(opts, cfg)
    seen = []
    for _ in range(cfg.training.steps):
        seen.append(opts.param_groups[0]["lr"])
        opts.step()
        sched.step()
    return seen, opts, sched


def test_linear_decay_right_after_warmup():
    lrs, _, _ = _lrs(_config())
    # warmup 1/3, 2/3; decay over the remaining 8 steps from 1 to 0
    expected = [1 / 3, 2 / 3] + [1 - k / 8 for k in range(1, 9)]
    assert lrs == pytest.approx(expected)


def test_wsd_stable_then_cosine_to_min():
    cfg = _config(steps=10, warmup=2, decay_ratio=0.4, decay_type="cosine", min_lr_factor=0.1)
    lrs, _, _ = _lrs(cfg)
    assert lrs[2:6] == pytest.approx([1.0] * 4)  # stable phase: steps 3..6
    decay = [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * k / 4)) for k in range(1, 5)]
    assert lrs[6:] == pytest.approx(decay)
    assert lrs[-1] == pytest.approx(0.1)


def test_sqrt_decay_and_factor_bounds():
    f = [
        lr_factor(
            s, warmup_steps=0, total_steps=4, decay_ratio=None, decay_type="sqrt", min_lr_factor=0.0
        )
        for s in range(1, 5)
    ]
    assert f == pytest.approx([1 - math.sqrt(k / 4) for k in range(1, 5)])
    with pytest.raises(ValueError, match="decay_type"):
        lr_factor(
            5, warmup_steps=0, total_steps=4, decay_ratio=None, decay_type="exp", min_lr_factor=0.0
        )


def test_state_dict_resume_continues_schedule():
    cfg = _config()
    full, _, _ = _lrs(cfg)
    model = torch.nn.Linear(2, 2)
    opts = build_optimizers([model], cfg)
    sched = build_lr_schedulers(opts, cfg)
    for _ in range(4):
        opts.step()
        sched.step()
    state = sched.state_dict()
    opts2 = build_optimizers([torch.nn.Linear(2, 2)], cfg)
    sched2 = build_lr_schedulers(opts2, cfg)
    sched2.load_state_dict(state)
    assert opts2.param_groups[0]["lr"] == pytest.approx(full[4])


def test_load_state_dict_after_optimizer_state_applies_this_jobs_schedule():
    """A finished run (lr 0) resumed with more steps and a new peak lr: the schedule,
    restored after the optimizer, replaces the saved lr and peak in every param group."""
    _, opts, sched = _lrs(_config(steps=10))
    assert opts.param_groups[0]["lr"] == 0.0
    cfg = _config(steps=20)
    cfg.optimizer.lr = 2.0
    model = torch.nn.Linear(2, 2)
    opts2 = build_optimizers([model], cfg)
    sched2 = build_lr_schedulers(opts2, cfg)
    opts2.load_state_dict(opts.state_dict())  # brings lr 0.0 and initial_lr 1.0
    sched2.load_state_dict(sched.state_dict())
    expected = 2.0 * lr_factor(
        11, warmup_steps=2, total_steps=20, decay_ratio=None, decay_type="linear", min_lr_factor=0.0
    )
    group = opts2.param_groups[0]
    assert (group["lr"], group["initial_lr"], sched2.get_last_lr()) == pytest.approx(
        (expected, 2.0, expected)
    )
