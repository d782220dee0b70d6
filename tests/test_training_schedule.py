"""The learning-rate schedule: one cycle is transformers' cosine-with-warmup, more cycles restart it exactly."""

import torch
from transformers import get_cosine_schedule_with_warmup

from hf_hyperdflash.training.loop import cosine_cycles_schedule


def learning_rates(scheduler: torch.optim.lr_scheduler.LRScheduler, steps: int) -> list[float]:
    rates = []
    for _ in range(steps):
        rates.append(scheduler.get_last_lr()[0])
        scheduler.optimizer.step()
        scheduler.step()
    return rates


def sgd() -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)


def test_one_cycle_matches_transformers_cosine_with_warmup():
    expected = learning_rates(get_cosine_schedule_with_warmup(sgd(), 10, 100), 100)
    torch.testing.assert_close(learning_rates(cosine_cycles_schedule(sgd(), 10, 100), 100), expected)


def test_each_cycle_repeats_warmup_and_decay():
    rates = learning_rates(cosine_cycles_schedule(sgd(), 10, 100), 300)
    assert rates[100:200] == rates[:100] == rates[200:]
    assert rates[100] == 0.0 and rates[110] == 2.0 and rates[199] < 1e-3
