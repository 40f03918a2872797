"""The scale rule alone, without threads: torch's ``_amp_update_scale_`` and DeepSpeed's
documented dynamic loss scaling with hysteresis as references."""

import random

import pytest
import torch

from roundpipe.scaler.rule import ScaleHyper, ScaleRule, check_hyper, check_hyper_field


def _flags(n, p, seed):
    rng = random.Random(seed)
    return [rng.random() < p for _ in range(n)]


def _flag(overflow):
    return torch.tensor(1.0 if overflow else 0.0)


@pytest.mark.parametrize("seed", range(4))
def test_plain_rule_is_torchs_amp_update_scale(seed):
    rule = ScaleRule(2.0**12, ScaleHyper(growth_factor=2.0, backoff_factor=0.5, growth_interval=3))
    scale = torch.full((), 2.0**12)
    tracker = torch.zeros((), dtype=torch.int32)
    for overflow in _flags(60, 0.2, seed):
        rule.apply(_flag(overflow))
        torch._amp_update_scale_(scale, tracker, _flag(overflow), 2.0, 0.5, 3)
        assert torch.equal(rule.scale, scale) and torch.equal(rule.growth_tracker, tracker)
    assert rule.steps == 60


class _DynamicLossScaler:
    """DeepSpeed's documented dynamic loss scaling (fp16 ``loss_scaler.DynamicLossScaler``):
    an overflow backs off (``scale / factor``, at least ``min_scale``) once the hysteresis
    counter is down to 1, else decrements it; every overflow restarts the growth window; the
    scale grows by ``factor`` after ``window`` iterations without overflow. The counter is
    refilled on every clean step with ``consecutive_hysteresis=True``, and only when the
    scale grows otherwise (DeepSpeed's default)."""

    def __init__(self, scale, factor, window, hysteresis, min_scale, consecutive):
        self.scale, self.factor, self.window = scale, factor, window
        self.hysteresis = self.left = hysteresis
        self.min_scale, self.consecutive = min_scale, consecutive
        self.iter, self.last_overflow = 0, -1

    def update(self, overflow):
        if overflow:
            if self.hysteresis == 1 or self.left == 1:
                self.scale = max(self.scale / self.factor, self.min_scale)
            else:
                self.left -= 1
            self.last_overflow = self.iter
        else:
            if self.consecutive:
                self.left = self.hysteresis
            if (self.iter - self.last_overflow) % self.window == 0:
                if not self.consecutive:
                    self.left = self.hysteresis
                self.scale *= self.factor
        self.iter += 1


@pytest.mark.parametrize("hysteresis", [1, 2, 3])
@pytest.mark.parametrize("seed", range(3))
def test_hysteresis_is_deepspeeds_consecutive_hysteresis(hysteresis, seed):
    rule = ScaleRule(2.0**10, ScaleHyper(growth_interval=4, hysteresis=hysteresis, min_scale=1.0))
    ref = _DynamicLossScaler(2.0**10, 2.0, 4, hysteresis, 1.0, consecutive=True)
    for overflow in _flags(200, 0.35, seed):
        rule.apply(_flag(overflow))
        ref.update(overflow)
        assert rule.scale.item() == ref.scale
    assert rule.skipped_steps.item() == sum(_flags(200, 0.35, seed))


def test_hysteresis_differs_from_deepspeeds_default_on_scattered_overflows():
    """Overflow, clean, overflow with hysteresis 2: DeepSpeed's default keeps the spent
    counter (the scale did not grow in between) and backs off; roundpipe's consecutive
    hysteresis refilled it on the clean step and tolerates the second overflow too."""
    flags = [True, False, True]
    rule = ScaleRule(1024.0, ScaleHyper(growth_interval=100, hysteresis=2))
    default = _DynamicLossScaler(1024.0, 2.0, 100, 2, 1.0, consecutive=False)
    for overflow in flags:
        rule.apply(_flag(overflow))
        default.update(overflow)
    assert rule.scale.item() == 1024.0
    assert default.scale == 512.0


def test_stale_scale_caps_the_backoff():
    rule = ScaleRule(2048.0, ScaleHyper(growth_interval=100))
    rule.apply(_flag(True), stale_scale=torch.tensor(1024.0))  # made with the stale 1024
    assert rule.scale.item() == 512.0  # min(2048 * 0.5, 1024 * 0.5)
    rule.apply(_flag(True), stale_scale=torch.tensor(1024.0))  # the stale scale repeats it
    assert rule.scale.item() == 512.0  # not backed off twice
    rule.apply(_flag(False), stale_scale=torch.tensor(1024.0))
    assert rule.scale.item() == 512.0 and rule.growth_tracker.item() == 1


def test_bounds_clamp_and_count_the_collapse_streak():
    rule = ScaleRule(8.0, ScaleHyper(growth_interval=1, min_scale=2.0, max_scale=16.0))
    for _ in range(3):
        rule.apply(_flag(False))
    assert rule.scale.item() == 16.0  # capped
    for _ in range(6):
        rule.apply(_flag(True))
    assert rule.scale.item() == 2.0
    assert rule.collapse_streak == 3  # overflows 4..6 found the scale already at min_scale
    rule.apply(_flag(False))
    assert rule.collapse_streak == 0
    assert rule.values() == (4.0, 0, 6)


@pytest.mark.parametrize(
    "name, value",
    [
        ("growth_factor", 1.0),
        ("growth_factor", float("inf")),
        ("backoff_factor", 2.0),
        ("backoff_factor", 0.0),
        ("growth_interval", 0),
        ("growth_interval", 2.0),
        ("growth_interval", True),
        ("hysteresis", 0),
        ("min_scale", -1.0),
        ("scale", -5.0),
        ("scale", float("nan")),
    ],
)
def test_one_validation_names_the_field(name, value):
    with pytest.raises(ValueError, match=name):
        check_hyper_field(name, value)


def test_check_hyper_bounds():
    with pytest.raises(ValueError, match="must not exceed"):
        check_hyper(ScaleHyper(min_scale=4.0, max_scale=2.0))
    with pytest.raises(ValueError, match="within"):
        check_hyper(ScaleHyper(min_scale=2.0), init_scale=1.0)
    with pytest.raises(ValueError, match="backoff_factor"):
        ScaleRule(1.0, ScaleHyper(backoff_factor=2.0))
