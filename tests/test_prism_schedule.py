"""PrismSchedule: presets, accepted and rejected schedules, construction errors."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import lamina
from lamina.schedule import (
    RULE_BASE_HALF,
    RULE_DIVIDES,
    RULE_ENDS_AT_BASE,
    RULE_NON_DECREASING,
    RULE_RUNS,
    PrismSchedule,
)

PRESET_SCALES = {
    "gpt2-small": (768, 12, 12),
    "gpt2-medium": (1024, 24, 16),
    "gpt2-large": (1280, 36, 20),
}
EARLY_HEAD_DIM = 256


def test_exported_from_lamina():
    assert lamina.PrismSchedule is PrismSchedule


def test_presets_listed():
    assert PrismSchedule.presets() == sorted(PRESET_SCALES)


@pytest.mark.parametrize("name", sorted(PRESET_SCALES))
def test_preset_scale_and_shape(name):
    d_model, n_layers, h_base = PRESET_SCALES[name]
    s = PrismSchedule.from_preset(name)
    assert (s.d_model, s.n_layers, s.h_base) == (d_model, n_layers, h_base)
    assert len(s.heads) == len(s.head_dims) == n_layers
    assert s.head_dims[0] == EARLY_HEAD_DIM
    assert s.heads[0] == d_model // EARLY_HEAD_DIM
    assert s.heads[-1] == h_base
    assert all(h * dim == d_model for h, dim in zip(s.heads, s.head_dims))
    assert not s.is_uniform
    # the same preset through the general constructor
    assert PrismSchedule(d_model, n_layers, h_base, preset=name) == s
    # the preset re-validates as plain widths
    assert PrismSchedule(d_model, n_layers, h_base, widths=list(s.heads)).heads == s.heads


def test_preset_dims_must_match():
    with pytest.raises(ValueError, match="gpt2-small.*768, 12, 12"):
        PrismSchedule(768, 24, 12, preset="gpt2-small")
    with pytest.raises(ValueError, match="preset must be one of"):
        PrismSchedule.from_preset("gpt3")
    with pytest.raises(TypeError, match="preset must be a str"):
        PrismSchedule.from_preset(3)


def test_uniform():
    s = PrismSchedule.uniform(768, 12, 12)
    assert s.heads == (12,) * 12
    assert s.head_dims == (64,) * 12
    assert s.is_uniform
    assert s.runs() == [(12, 0, 12)]
    with pytest.raises(ValueError, match=RULE_DIVIDES):
        PrismSchedule.uniform(768, 12, 7)


def test_runs():
    s = PrismSchedule(64, 10, 8, widths=[2, 2, 2, 4, 4, 8, 8, 8, 8, 8])
    assert s.runs() == [(2, 0, 3), (4, 3, 2), (8, 5, 5)]
    assert s.head_dims == (32, 32, 32, 16, 16, 8, 8, 8, 8, 8)


ACCEPTED = [
    # (d_model, h_base, widths)
    (64, 4, [4]),  # one layer
    (64, 4, [4] * 5),  # uniform, final block longer than 4
    (64, 8, [2, 2, 8, 8]),  # run of 2 then half at h_base
    (64, 8, [2, 2, 2, 8, 8, 8]),  # run of 3
    (64, 8, [2, 2, 2, 2, 8, 8, 8, 8]),  # run of 4
    (64, 8, [1, 1, 2, 2, 4, 4, 8, 8, 8, 8, 8, 8]),  # several runs
    (64, 8, [2, 2, 8, 8, 8]),  # odd L: 3 of 5 >= 5/2
    (96, 12, [3, 3, 4, 4, 6, 6] + [12] * 6),  # non powers of two (head dims 32, 24, 16, 8)
    (64, 4, [2, 2] + [4] * 20),  # final block far longer than 4
]


@pytest.mark.parametrize("d_model,h_base,widths", ACCEPTED)
def test_accepted(d_model, h_base, widths):
    s = PrismSchedule(d_model, len(widths), h_base, widths=widths)
    assert s.heads == tuple(widths)
    assert list(s) == widths and len(s) == len(widths) and s[0] == widths[0]
    assert sum(length for _, _, length in s.runs()) == len(widths)


REJECTED = [
    # (d_model, h_base, widths, rule, layer)
    (64, 8, [3, 3, 8, 8], RULE_DIVIDES, 0),
    (64, 8, [2, 2, 8, 8, 8, 6], RULE_DIVIDES, 5),
    (64, 8, [4, 4, 2, 2, 8, 8, 8, 8], RULE_NON_DECREASING, 2),
    (64, 8, [2, 2, 8, 8, 4], RULE_NON_DECREASING, 4),
    (64, 8, [2, 2, 4, 4, 4, 4], RULE_ENDS_AT_BASE, 5),
    (64, 4, [2, 2, 8, 8, 8, 8], RULE_ENDS_AT_BASE, 5),  # ends above h_base
    (64, 8, [2, 8, 8], RULE_RUNS, 0),  # run of 1
    (64, 8, [2, 2, 4, 8, 8, 8, 8], RULE_RUNS, 2),  # run of 1 in the middle
    (64, 8, [2] * 5 + [8] * 5, RULE_RUNS, 0),  # run of 5 before the final block
    (64, 8, [2, 2, 4, 4, 8, 8, 8], RULE_BASE_HALF, 4),  # 3 of 7 at h_base
    (64, 8, [2, 2, 2, 4, 4, 4, 8, 8, 8, 8, 8], RULE_BASE_HALF, 6),  # 5 of 11
]


@pytest.mark.parametrize("d_model,h_base,widths,rule,layer", REJECTED)
def test_rejected_names_rule_and_layer(d_model, h_base, widths, rule, layer):
    with pytest.raises(ValueError) as info:
        PrismSchedule(d_model, len(widths), h_base, widths=widths)
    message = str(info.value)
    assert f"'{rule}'" in message, message
    assert f"at layer {layer}:" in message, message


@pytest.mark.parametrize(
    "kwargs,exc,pattern",
    [
        (dict(d_model=64, n_layers=2, h_base=4), ValueError, "exactly one of widths= .* and preset="),
        (dict(d_model=768, n_layers=12, h_base=12, widths=[12] * 12, preset="gpt2-small"), ValueError,
         "exactly one of"),
        (dict(d_model=64, n_layers=3, h_base=4, widths=[4, 4]), ValueError, "n_layers=3 entries, got 2"),
        (dict(d_model=64, n_layers=2, h_base=4, widths="44"), TypeError, "widths must be a sequence"),
        (dict(d_model=64, n_layers=2, h_base=4, widths=[4, 4.0]), TypeError, r"widths\[1\] must be an int"),
        (dict(d_model=64, n_layers=2, h_base=4, widths=[0, 4]), ValueError, r"widths\[0\] must be >= 1, got 0"),
        (dict(d_model=0, n_layers=2, h_base=4, widths=[4, 4]), ValueError, "d_model must be >= 1"),
        (dict(d_model=64.0, n_layers=2, h_base=4, widths=[4, 4]), TypeError, "d_model must be an int, got float"),
        (dict(d_model=64, n_layers=True, h_base=4, widths=[4]), TypeError, "n_layers must be an int, got bool"),
    ],
)
def test_bad_arguments(kwargs, exc, pattern):
    with pytest.raises(exc, match=pattern):
        PrismSchedule(**kwargs)


def test_from_head_dims():
    s = PrismSchedule.from_head_dims(768, [256, 256, 192, 192, 128, 128] + [64] * 6)
    assert s == PrismSchedule.from_preset("gpt2-small")
    with pytest.raises(ValueError, match=f"'{RULE_DIVIDES}' violated at layer 1"):
        PrismSchedule.from_head_dims(768, [256, 100, 64, 64])
    with pytest.raises(ValueError, match="head_dims must be a non-empty sequence"):
        PrismSchedule.from_head_dims(768, [])


def test_schedules_compare_by_heads():
    a = PrismSchedule(768, 12, 12, preset="gpt2-small")
    b = PrismSchedule(768, 12, 12, widths=a.heads)
    assert a == b and hash(a) == hash(b)
    assert a != PrismSchedule.uniform(768, 12, 12)


def _rules_hold(d_model: int, h_base: int, widths: list[int]) -> bool:
    """Independent statement of the rules (run lengths counted by scanning boundaries)."""
    n = len(widths)
    if any(d_model % h for h in widths):
        return False
    if any(b < a for a, b in zip(widths, widths[1:])):
        return False
    if widths[-1] != h_base:
        return False
    if 2 * widths.count(h_base) < n:
        return False
    boundaries = [0] + [i for i in range(1, n) if widths[i] != widths[i - 1]] + [n]
    lengths = [b - a for a, b in zip(boundaries, boundaries[1:])]
    return all(2 <= length <= 4 for length in lengths[:-1])


@st.composite
def _candidate_widths(draw) -> list[int]:
    """Mostly sorted runs of head counts with lengths 1..7 (so run-length and L/2 edges are hit),
    sometimes shuffled or with a non-divisor."""
    values = sorted(draw(st.sets(st.sampled_from([1, 2, 3, 4, 6, 8, 12]), min_size=1, max_size=4)))
    lengths = draw(st.lists(st.integers(1, 7), min_size=len(values), max_size=len(values)))
    widths = [h for h, n in zip(values, lengths) for _ in range(n)]
    if draw(st.integers(0, 9)) == 0:
        widths = draw(st.permutations(widths))
    if draw(st.integers(0, 9)) == 0:
        widths[draw(st.integers(0, len(widths) - 1))] = 5  # does not divide 96
    return list(widths)


@settings(max_examples=400, deadline=None)
@given(widths=_candidate_widths(), h_base=st.sampled_from([4, 6, 8, 12]))
def test_validator_agrees_with_independent_rules(widths, h_base):
    d_model = 96
    expected = _rules_hold(d_model, h_base, widths)
    try:
        PrismSchedule(d_model, len(widths), h_base, widths=widths)
        accepted = True
    except ValueError:
        accepted = False
    assert accepted == expected, (widths, h_base)


# --- PrismSchedule.generate -------------------------------------------------------------------------

@st.composite
def _model_shape(draw) -> tuple[int, int, int]:
    """(d_model, n_layers, h_base): d_model a multiple of 8 up to 4096, h_base with a head dim of 32..256."""
    d_model = 8 * draw(st.integers(2, 512))
    bases = [h for h in range(1, d_model + 1) if d_model % h == 0 and 32 <= d_model // h <= 256
             and (d_model // h) % 8 == 0]
    h_base = draw(st.sampled_from(bases)) if bases else d_model // 8
    return d_model, draw(st.integers(1, 48)), h_base


@settings(max_examples=300, deadline=None)
@given(shape=_model_shape(), profile=st.sampled_from(["coarse", "fine"]))
def test_generated_schedules_follow_the_rules(shape, profile):
    d_model, n_layers, h_base = shape
    schedule = PrismSchedule.generate(d_model, n_layers, h_base, profile=profile)
    assert _rules_hold(d_model, h_base, list(schedule.heads))  # the independent statement of the rules
    assert (schedule.d_model, schedule.n_layers, schedule.h_base) == shape
    wider = [d for d in schedule.head_dims if d != d_model // h_base]
    assert all(d <= 256 and d % 8 == 0 and d > d_model // h_base for d in wider)
    if wider:  # the staircase starts at the widest allowed head dim
        widest = max(d for d in range(8, 257, 8) if d_model % d == 0 and d_model // d < h_base)
        assert schedule.head_dims[0] == widest


def test_generate_profiles_and_uniform_fallback():
    coarse = PrismSchedule.generate(768, 12, 12, profile="coarse")
    fine = PrismSchedule.generate(768, 12, 12, profile="fine")
    assert coarse.head_dims == (256,) * 3 + (96,) * 3 + (64,) * 6
    assert fine.head_dims == (256, 256, 128, 128, 96, 96) + (64,) * 6
    assert len(fine.runs()) > len(coarse.runs())
    assert PrismSchedule.generate(96, 3, 2).is_uniform  # one layer to spend: no staircase
    assert PrismSchedule.generate(512, 8, 2).is_uniform  # no head dim between 256 and 512 allowed
    with pytest.raises(ValueError, match="profile"):
        PrismSchedule.generate(768, 12, 12, profile="steep")
    with pytest.raises(ValueError, match="divides d_model"):
        PrismSchedule.generate(768, 12, 7)


@pytest.mark.parametrize("shape", [(64, 4, 4), (128, 8, 4), (192, 6, 6)])
def test_generated_schedule_has_the_uniform_parameter_count(shape):
    from lamina.layers import PrismDecoder, PrismDecoderConfig

    d_model, n_layers, h_base = shape
    schedule = PrismSchedule.generate(d_model, n_layers, h_base, profile="fine")
    assert not schedule.is_uniform
    prism = PrismDecoder(PrismDecoderConfig(50, d_model, n_layers, h_base, widths=schedule.heads))
    uniform = PrismDecoder(PrismDecoderConfig(50, d_model, n_layers, h_base))
    assert prism.num_parameters() == uniform.num_parameters()
