"""The verdict rule of study v4 (txl_tf.study.evidence; docs/study_plan.md): Student's t over per-seed
differences, Holm within a family, every seed's sign, and the noise share of a RECL. Figures checked by hand or
against published tables; the claims over archived seeds are tested in tests/test_study.py."""

import math

import numpy as np
import pytest

from txl_tf.analysis import recl
from txl_tf.study import evidence


@pytest.mark.parametrize("df, quantile", [(1, 12.7062), (2, 4.3027), (3, 3.1824), (4, 2.7764), (9, 2.2622)])
def test_t_quantiles_match_the_published_table(df, quantile):
    assert math.isclose(evidence.t_quantile(0.95, df), quantile, abs_tol=5e-4)
    assert math.isclose(evidence.t_two_sided_p(quantile, df), 0.05, abs_tol=1e-4)


def test_t_p_values_by_hand():
    assert math.isclose(evidence.t_two_sided_p(1.0, 1), 0.5, abs_tol=1e-12)  # Cauchy: P(|T| >= 1) = 1/2
    assert math.isclose(evidence.t_two_sided_p(2.0, 2), 1 - 2 / math.sqrt(6), abs_tol=1e-12)  # 1 - t/sqrt(2+t^2)
    assert evidence.t_two_sided_p(0.0, 3) == 1.0 and evidence.t_two_sided_p(math.inf, 3) == 0.0
    with pytest.raises(ValueError):
        evidence.t_two_sided_p(1.0, 0)


def test_the_seed_interval_is_t_over_the_differences():
    d = [-0.03, -0.01, -0.02]
    c = evidence.seed_interval(d)
    half = 4.302653 * 0.01 / math.sqrt(3)  # t(0.975, 2) * s / sqrt(n), s = 0.01
    assert math.isclose(c["mean"], -0.02) and math.isclose(c["high"] - c["mean"], half, rel_tol=1e-4)
    assert c["n"] == 3 and c["seeds"] == d
    one = evidence.seed_interval([-0.5])  # one seed: no interval, nothing claimed
    assert one["low"] == -math.inf and one["high"] == math.inf and one["p"] == 1.0


def test_holm_adjusts_step_down_and_stays_monotone():
    adjusted = evidence.holm({"a": 0.01, "b": 0.04, "c": 0.03, "d": 0.5})
    assert adjusted == pytest.approx({"a": 0.04, "c": 0.09, "b": 0.09, "d": 0.5})


@pytest.mark.parametrize("seeds, expected", [
    ([-0.30, -0.31, -0.29], "reproduced"),
    ([0.30, 0.31, 0.29], "reversed"),
    ([-0.30, -0.31, 0.05], "undecided"),  # one seed of the other sign
    ([-0.30, -0.31], "undecided"),  # fewer than the plan's three seeds
])
def test_a_verdict_needs_every_seed_and_the_corrected_test(seeds, expected):
    decided = evidence.decide({"claim": seeds})["claim"]
    assert decided["verdict"] == expected


def test_holm_can_leave_a_claim_undecided_that_alone_would_pass():
    marginal = [-0.010, -0.008, -0.006]  # t = 6.93 on 2 degrees of freedom: p = 1 - t / sqrt(2 + t^2) = 0.020
    assert math.isclose(evidence.seed_interval(marginal)["p"], 1 - 6.9282 / math.sqrt(2 + 6.9282 ** 2), rel_tol=1e-3)
    alone = evidence.decide({"m": marginal})["m"]
    family = evidence.decide({"m": marginal, "x": [0.01, -0.02, 0.03], "y": [0.02, -0.01, -0.005]})["m"]
    assert alone["verdict"] == "reproduced"
    assert family["verdict"] == "undecided" and family["p_holm"] > 0.05 and "Holm" in evidence.why(family)


def test_the_noise_share_counts_gain_earned_while_the_model_got_worse():
    # Two models, three contexts, four tokens. Model 1 ("noisy") beats the baseline on one hard token at each step
    # while its mean rises at the first step; model 0 improves steadily.
    losses = np.array([
        [[2.0, 2.0, 2.0, 2.0], [1.8, 1.8, 1.8, 1.8], [1.6, 1.6, 1.6, 1.6]],
        [[2.5, 2.5, 2.5, 2.5], [1.0, 4.0, 4.0, 4.0], [0.5, 3.0, 3.0, 3.0]],
    ])
    contexts = (8, 16, 24)
    result = recl.compute_recl(losses, contexts, r=1.0)
    gains = recl.relative_gains(losses, r=1.0)
    share = evidence.recl_noise_share(losses, 1.0, [contexts.index(x) for x in result.recl])
    assert share[0] == 0.0  # its mean fell at every step
    counted = [k for k in range(2) if k < contexts.index(result.recl[1])]
    assert counted == [0, 1]  # both steps count for the noisy model (truncated: still "gaining")
    # its mean rose at step 0 (2.5 -> 2.5 + 0.75), fell at step 1 (3.25 -> 2.375)
    assert math.isclose(share[1], gains[1, 0] / (gains[1, 0] + gains[1, 1]), rel_tol=1e-12)
    assert 0.0 < share[1] < 1.0
    assert evidence.recl_noise_share(losses, 1.0, 0).tolist() == [0.0, 0.0]  # no step counted: no share


def test_a_which_model_row_names_a_model_only_when_it_leads_alone_in_every_seed():
    ahead = [{"xl": 512, "shaw": 256}, {"xl": 768, "shaw": 512}, {"xl": 512, "shaw": 256}]
    assert evidence.same_leader(ahead) == "xl"
    assert evidence.same_leader(ahead[:2]) is None  # fewer seeds than the plan's three
    tied = [*ahead[:2], {"xl": 512, "shaw": 512}]  # a tie at the top in one seed: no leader there
    assert evidence.same_leader(tied) is None
    changes = [*ahead[:2], {"xl": 256, "shaw": 512}]  # another model leads in one seed
    assert evidence.same_leader(changes) is None


def test_the_furthest_copy_is_the_longest_distance_whose_interval_is_below_zero():
    cells = {"128": {"copy_high": -0.01}, "256": {"copy_high": 0.002}, "512": {"copy_high": -0.001},
             "1024": {"copy_high": 0.0}}
    assert evidence.furthest_copy(cells, [128, 256, 512, 1024]) == 512  # 1024's interval reaches zero
    assert evidence.furthest_copy(cells, [256, 1024]) == 0  # none significant
