"""Quality metrics against float64 references computed by hand (no sklearn)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from loka_tune.errors import DataError
from loka_tune.objectives.metrics import (
    auc,
    binary_entropy,
    log_loss,
    normalized_entropy,
    relative_log_loss,
)


def naive_log_loss(y, p):
    return sum(-(yi * math.log(pi) + (1 - yi) * math.log(1 - pi)) for yi, pi in zip(y, p)) / len(y)


def sigmoid(z):
    return 1.0 / (1.0 + math.exp(-z))


def pair_count_auc(y, s):
    """AUC by counting every (positive, negative) pair: 1 if ranked right, 1/2 if tied."""
    pos = [si for yi, si in zip(y, s) if yi == 1]
    neg = [si for yi, si in zip(y, s) if yi == 0]
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p, n in itertools.product(pos, neg))
    return wins / (len(pos) * len(neg))


def test_log_loss_small_table():
    y = [1, 0, 1, 1, 0]
    z = [2.0, -1.0, 0.0, -0.5, 3.0]
    ref = naive_log_loss(y, [sigmoid(v) for v in z])
    assert log_loss(y, z) == pytest.approx(ref, rel=1e-14)
    assert log_loss(y, [sigmoid(v) for v in z], from_logits=False) == pytest.approx(ref, rel=1e-12)
    # a value worked by hand: one example, logit 0 -> log 2
    assert log_loss([1], [0.0]) == pytest.approx(math.log(2), rel=1e-15)


def test_log_loss_random_against_float64_and_input_types():
    rng = np.random.default_rng(0)
    z = rng.normal(0, 3, 500)
    y = (rng.random(500) < 1 / (1 + np.exp(-z))).astype(np.float64)
    ref = naive_log_loss(y, [sigmoid(v) for v in z])
    assert log_loss(y, z) == pytest.approx(ref, rel=1e-12)
    # float32 / bf16 torch inputs are upcast to float64 before the math
    z32 = torch.tensor(z, dtype=torch.float32)
    ref32 = naive_log_loss(y, [sigmoid(float(v)) for v in z32])
    assert log_loss(torch.tensor(y), z32) == pytest.approx(ref32, rel=1e-12)
    zbf = z32.bfloat16()
    refbf = naive_log_loss(y, [sigmoid(float(v)) for v in zbf.float()])
    assert log_loss(list(y), zbf) == pytest.approx(refbf, rel=1e-12)
    assert isinstance(log_loss(y, z), float)


def test_log_loss_is_stable_for_huge_logits():
    # naive sigmoid-then-log gives inf / nan here; the stable form is exact
    assert log_loss([1, 0], [800.0, -800.0]) == pytest.approx(0.0, abs=1e-300)
    assert log_loss([0], [800.0]) == pytest.approx(800.0, rel=1e-15)
    assert log_loss([1], [-1000.0]) == pytest.approx(1000.0, rel=1e-15)
    # probabilities are clipped: a certain wrong guess costs -log(1e-15), not inf
    assert log_loss([1], [0.0], from_logits=False) == pytest.approx(-math.log(1e-15), rel=1e-6)
    assert math.isnan(log_loss([1, 0], [float("nan"), 0.0]))


def test_binary_entropy_and_ne():
    assert binary_entropy(0.5) == pytest.approx(math.log(2), rel=1e-15)
    assert binary_entropy(0.0) == 0.0 == binary_entropy(1.0)
    p = 0.21
    assert binary_entropy(p) == pytest.approx(-(p * math.log(p) + (1 - p) * math.log(1 - p)), rel=1e-15)
    y = [1, 0, 0, 0, 1, 0, 0, 0]  # mean click rate 1/4
    z = [1.5, -2.0, -0.3, -1.0, 0.2, -3.0, 0.5, -1.2]
    h = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    ref = naive_log_loss(y, [sigmoid(v) for v in z]) / h
    assert normalized_entropy(y, z) == pytest.approx(ref, rel=1e-13)
    # predicting the mean click rate everywhere gives NE = 1 exactly
    z_const = [math.log(0.25 / 0.75)] * 8
    assert normalized_entropy(y, z_const) == pytest.approx(1.0, rel=1e-13)
    assert math.isnan(normalized_entropy([1, 1, 1], [0.0, 1.0, 2.0]))


def test_auc_small_table_by_pair_counting():
    y = [1, 0, 1, 0, 0, 1, 0]
    s = [0.9, 0.1, 0.4, 0.4, 0.35, 0.8, 0.7]  # one tie across classes (0.4)
    ref = pair_count_auc(y, s)
    assert ref == pytest.approx(10.5 / 12)  # by hand: 3 positives x 4 negatives, one tie
    assert auc(y, s) == pytest.approx(ref, rel=1e-15)


def test_auc_random_with_many_ties():
    rng = np.random.default_rng(1)
    y = (rng.random(300) < 0.3).astype(np.float64)
    s = np.round(rng.normal(y, 1.0), 1)  # rounding creates many ties
    assert auc(y, s) == pytest.approx(pair_count_auc(y.tolist(), s.tolist()), rel=1e-13)
    assert auc(torch.tensor(y), torch.tensor(s, dtype=torch.float32)) == pytest.approx(
        pair_count_auc(y.tolist(), torch.tensor(s, dtype=torch.float32).tolist()), rel=1e-13
    )


def test_average_ranks_match_scipy():
    from scipy.stats import rankdata

    from loka_tune.objectives.metrics import _average_ranks

    rng = np.random.default_rng(2)
    for n in (1, 2, 7, 50, 333):
        s = np.round(rng.normal(size=n), 1)  # many ties
        assert np.array_equal(_average_ranks(s), rankdata(s, method="average"))


def test_auc_edges():
    assert auc([0, 0, 1, 1], [1, 2, 3, 4]) == 1.0
    assert auc([0, 0, 1, 1], [4, 3, 2, 1]) == 0.0
    assert auc([0, 1, 0, 1], [5, 5, 5, 5]) == 0.5
    assert math.isnan(auc([1, 1], [0.2, 0.3]))
    assert math.isnan(auc([0, 1], [float("nan"), 0.3]))
    with pytest.raises(DataError, match="exactly 0 or 1"):
        auc([0.5, 1], [0.1, 0.2])


def test_relative_log_loss():
    assert relative_log_loss(0.4402, 0.44) == pytest.approx(0.0002 / 0.44, rel=1e-12)
    assert relative_log_loss(0.44, 0.44) == 0.0
    assert relative_log_loss(0.43, 0.44) < 0  # better than the baseline
    # percent is the fraction x 100: a 0.02% degradation
    assert 100 * relative_log_loss(0.44 * 1.0002, 0.44) == pytest.approx(0.02, rel=1e-9)
    with pytest.raises(DataError, match="baseline"):
        relative_log_loss(0.4, 0.0)
    with pytest.raises(DataError, match="baseline"):
        relative_log_loss(0.4, float("nan"))


def test_malformed_inputs_raise_data_errors():
    with pytest.raises(DataError, match="empty"):
        log_loss([], [])
    with pytest.raises(DataError, match="differ in length: 2 vs 3"):
        log_loss([0, 1], [0.1, 0.2, 0.3])
    with pytest.raises(DataError, match=r"\[0, 1\]"):
        log_loss([2, 0], [0.1, 0.2])
    with pytest.raises(DataError, match="from_logits=True"):
        log_loss([1, 0], [1.5, 0.2], from_logits=False)
