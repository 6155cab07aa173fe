"""HRM-LM: parameter report (the L-fold reduction), forward contract, and a CPU training smoke test."""

from __future__ import annotations

import time

import pytest
import torch

from lamina.models.hrm_lm import HRMLM, CausalBlock, HRMLMConfig, parameter_report

# Copy task: a random first half of VOCAB tokens, then the same tokens again; the loss is taken
# on the second half only, where a model that copies is exact and a guessing one pays ln(VOCAB).
VOCAB, HALF, BATCH = 16, 8, 32
TRAIN_STEPS = 100
LEARNING_RATE = 1e-2
# Stated margin: the mean loss over the last 10 steps must fall below this fraction of chance
# level ln(16) = 2.77. Measured here (seeds 0-2): 0.008-0.042 after 100 steps, ~chance for the first 40.
LOSS_FRACTION_OF_CHANCE = 0.35
TIME_LIMIT_S = 30.0


def test_parameter_report_flat_is_l_fold():
    cfg = HRMLMConfig(mode="flat", n_cycles=3, steps_per_cycle=4, grad_steps=2)
    report = parameter_report(cfg)
    block = sum(p.numel() for p in CausalBlock(cfg.d_model, cfg.n_heads, cfg.mlp_ratio).parameters())
    assert report.depth == 12 and report.stored_blocks == 1 and report.block == block
    assert report.transformer_core == 12 * block
    assert report.hrm_core == block + cfg.d_model  # one block and the initial state
    assert 0.99 * 12 < report.reduction <= 12
    assert report.transformer_total - report.hrm_total == 11 * block - cfg.d_model


def test_parameter_report_hierarchical():
    cfg = HRMLMConfig.family("small")
    report = parameter_report(cfg)  # built on the meta device: no 100M-parameter allocation
    d = cfg.d_model
    assert report.depth == cfg.steps + cfg.n_cycles == 10 and report.stored_blocks == 2
    # three gated updates (fast and output gates see [h, c, x], the slow gate [h, c]) and two initial states
    gates = (3 * d * d + d + d) + (2 * d * d + d + d) + (3 * d * d + d + d)
    assert report.hrm_core == 2 * report.block + gates + 2 * d
    assert report.transformer_core == 10 * report.block
    # L block applications from 2 stored blocks; the gates (8 d^2, 2/3 of a block) take part of the gain
    assert report.reduction == pytest.approx(report.depth * report.block / (2 * report.block + gates + 2 * d))
    assert report.reduction > 3
    assert "10-layer transformer" in str(report)


def test_forward_contract():
    cfg = HRMLMConfig(vocab_size=32, d_model=32, n_heads=2, max_seq_len=16, passes=2, backend="torch")
    model = HRMLM(cfg)
    ids = torch.randint(0, 32, (2, 10))
    out = model(ids, ids)
    assert len(out.logits) == 2 and out.logits[0].shape == (2, 10, 32)
    assert out.loss is not None and out.loss.ndim == 0
    assert model(ids).loss is None
    with pytest.raises(ValueError, match="exceeds max_seq_len 16"):
        model(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match="d_model .* must be a multiple of n_heads"):
        HRMLMConfig(d_model=30, n_heads=4)
    with pytest.raises(ValueError, match="size must be one of"):
        HRMLMConfig.family("huge")


def copy_batch(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    first = torch.randint(0, VOCAB, (BATCH, HALF), generator=generator)
    ids = torch.cat([first, first], dim=1)
    targets = torch.full_like(ids, -100)
    targets[:, HALF - 1:-1] = ids[:, HALF:]  # position t predicts token t + 1 of the repeat
    return ids, targets


def test_hrm_lm_learns_a_copy_task_on_cpu():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: one thread avoids contention on a shared 2-core machine
    try:
        torch.manual_seed(0)
        cfg = HRMLMConfig(vocab_size=VOCAB, d_model=64, n_heads=4, max_seq_len=2 * HALF, n_cycles=2,
                          steps_per_cycle=2, grad_steps=2, backend="torch")
        model = HRMLM(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
        generator = torch.Generator().manual_seed(0)
        losses = []
        start = time.perf_counter()
        for _ in range(TRAIN_STEPS):
            ids, targets = copy_batch(generator)
            loss = model(ids, targets).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        elapsed = time.perf_counter() - start
    finally:
        torch.set_num_threads(threads)
    chance = torch.log(torch.tensor(float(VOCAB))).item()
    final = sum(losses[-10:]) / 10
    assert final < LOSS_FRACTION_OF_CHANCE * chance, f"loss {losses[0]:.3f} -> {final:.3f} (chance {chance:.3f})"
    assert elapsed < TIME_LIMIT_S, f"{TRAIN_STEPS} steps took {elapsed:.1f} s"
