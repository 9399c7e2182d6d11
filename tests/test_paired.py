"""Paired comparisons: the statistics against hand-computed values, the report's pairing by seed, and the premise
that makes pairing worth it — a DIFF member and its matched Transformer member of one seed start from the same
values for every parameter they have in common."""

import math

import jax
import numpy as np
import pytest

from diffjax import sweep as sweep_lib
from diffjax.stats import paired
from diffjax.sweep.report import paired_rows
from diffjax.train.optim import make_optimizer
from diffjax.train.state import make_init


def _planted(rng, differences):
    """Random per-seed baselines b, and a = b + the planted differences, under shuffled seed labels."""
    seeds = rng.permutation(100)[: len(differences)]
    b = {int(s): float(rng.normal(2.0, 0.5)) for s in seeds}
    return {s: b[s] + d for s, d in zip(b, differences, strict=True)}, b


def test_three_seeds_match_the_closed_form(rng):
    a, b = _planted(rng, [0.1, 0.2, 0.3])
    result = paired(a, b)
    t = 0.2 / (0.1 / math.sqrt(3))
    # Student's t with 2 degrees of freedom: CDF(t) = 1/2 + t / (2·sqrt(2 + t²))
    assert result.n == 3 and result.mean == pytest.approx(0.2)
    assert result.p == pytest.approx(1 - t / math.sqrt(2 + t * t), rel=1e-9)
    # bootstrap means of 3 draws from {.1,.2,.3}: P(all .1) = 1/27 > 2.5 %, so the interval is the extremes
    assert result.ci == pytest.approx((0.1, 0.3))
    assert sorted(result.diffs) == pytest.approx([0.1, 0.2, 0.3])  # each seed's own difference, a − b
    assert not result.detected and "no detectable difference at n = 3" in result.sentence("diff", "transformer")


def test_five_seeds_at_the_critical_t_give_p_of_five_percent(rng):
    noise = rng.normal(0, 1, 5)
    noise = (noise - noise.mean()) / noise.std(ddof=1) * 0.01  # zero mean, sd 0.01
    shift = 2.776445 * 0.01 / math.sqrt(5)  # t(0.975; df 4) = 2.776445 (tables)
    a, b = _planted(rng, list(shift + noise))
    assert paired(a, b).p == pytest.approx(0.05, rel=1e-4)
    a, b = _planted(rng, list(3 * shift + noise))
    result = paired(a, b)
    assert result.detected and result.ci[0] > 0 and result.sentence("diff", "transformer").endswith("diff is higher")


def _p_three_seeds(differences):
    """By hand: the two-sided paired t-test p of three differences (2 degrees of freedom: p = 1 − |t| / √(2 + t²))."""
    t = np.mean(differences) / (np.std(differences, ddof=1) / math.sqrt(3))
    return 1 - abs(t) / math.sqrt(2 + t * t)


def test_a_difference_under_the_resolution_is_no_measurable_difference_whatever_its_p(rng):
    """The newcomer's report: −0.00004 nats in every seed, p ≈ 2e-4, printed as −0.0000 and once called a finding."""
    differences = [-4.0e-5, -4.1e-5, -3.9e-5]
    result = paired(*_planted(rng, differences))
    assert result.p == pytest.approx(_p_three_seeds(differences), rel=1e-6) and result.p < 0.001 and result.detected
    reading = "no measurable difference at resolution 0.0001"  # one unit of the 4th decimal the line prints
    assert result.sentence("diff", "transformer").endswith(f"n = 3): {reading}")
    assert result.cells("diff").endswith(f"| -0.0000 | {result.ci[0]:+.4f} to {result.ci[1]:+.4f} | "
                                         f"{result.p:.3g} | {reading}")
    # printed to 6 decimals the same difference is measurable, and detected
    assert result.cells("diff", digits=6).endswith("| -0.000040 | -0.000041 to -0.000039 | "
                                                   f"{result.p:.3g} | diff is lower")
    # a minimum effect the report names, above a real difference
    real = paired(*_planted(rng, [-0.10, -0.11, -0.12]))
    assert real.sentence("diff", "transformer", resolution=0.2).endswith("no measurable difference at resolution 0.2")


def test_two_seeds_are_too_few_to_judge_whatever_their_p(rng):
    result = paired(*_planted(rng, [1.0, 1.0001]))  # t = 20001 with 1 degree of freedom: p = 3.2e-5, by hand
    assert result.n == 2 and result.p == pytest.approx(2 / (math.pi * 20001), rel=1e-4)
    assert result.sentence("diff", "transformer").endswith("p = 3.18e-05, n = 2): too few seeds to judge at n = 2")
    same = paired({0: 2.5, 7: 1.75}, {0: 2.0, 7: 1.25})  # the same difference in both seeds: p = 0, still two
    assert same.p == 0 and same.cells("diff").endswith("| 0 | too few seeds to judge at n = 2")


def test_a_real_difference_at_three_seeds_gets_its_verdict(rng):
    differences = [-0.10, -0.11, -0.12]  # t = −0.11 / (0.01 / √3) = −19.05: p = 0.0027 by hand
    result = paired(*_planted(rng, differences))
    assert result.p == pytest.approx(_p_three_seeds(differences), rel=1e-6)
    assert result.p == pytest.approx(0.002743, abs=1e-6)
    assert result.sentence("diff", "transformer").endswith("p = 0.00274, n = 3): diff is lower")
    assert paired(*_planted(rng, [0.10, 0.11, 0.12])).verdict("diff", 1e-4) == "diff is higher"


def test_only_seeds_both_have_with_finite_values_pair(rng):
    a, b = _planted(rng, [0.1, 0.2, 0.3, 0.4])
    seeds = list(a)
    a[seeds[0]] = math.nan  # a diverged member
    del b[seeds[1]]  # a seed the reference lacks
    a[1000] = 5.0  # a seed only `a` has
    result = paired(a, b)
    assert result.n == 2 and result.mean == pytest.approx(0.35)
    one = paired({0: 1.0}, {0: 2.0})
    assert one.n == 1 and math.isnan(one.p)
    # a table row of one seed: its difference, no interval or p (not "nan")
    assert one.cells("diff").split(" | ") == ["1", "-1.0000", "-1.0000", "—", "—", "too few seeds to judge at n = 1"]
    assert paired(a, b).cells("diff").split(" | ")[3:5] == [f"{result.ci[0]:+.4f} to {result.ci[1]:+.4f}",
                                                            f"{result.p:.3g}"]


def test_the_report_pairs_members_by_seed_and_leaves_diverged_ones_out():
    rows = [{"variant": v, "seed": s, "val_loss": loss, "diverged": div}
            for v, s, loss, div in [("diff", 0, 2.0, False), ("diff", 1, 2.5, False), ("diff", 2, 9.0, True),
                                    ("transformer", 1, 2.7, False), ("transformer", 0, 2.1, False),
                                    ("transformer", 2, 2.2, False)]]
    (variant, row), = paired_rows(rows, "transformer").items()
    assert variant == "diff" and row.n == 2 and row.mean == pytest.approx(-0.15)
    assert row.per_seed() == "-0.1000, -0.2000"  # seed 0, then seed 1


def test_matched_archs_of_one_seed_start_from_the_same_common_parameters():
    sweep = sweep_lib.load("configs/main.py:seeds=2,steps=10")
    params = {}
    for m in sweep.members:
        cfg = m.config
        state = make_init(cfg, make_optimizer(cfg.optim, cfg.train.steps))(np.uint32(cfg.train.seed))
        params[m.name] = {jax.tree_util.keystr(p): np.asarray(v)
                          for p, v in jax.tree_util.tree_flatten_with_path(state.params)[0]}
    diff, base, other_seed = params["diff__seed0"], params["transformer__seed0"], params["transformer__seed1"]
    common = set(diff) & set(base)
    assert {k for k in diff if k not in base} == {k for k in diff if "lambda" in k or "head_norm" in k}
    assert len(common) == len(base)  # every Transformer parameter has a DIFF twin
    for k in common:
        np.testing.assert_array_equal(diff[k], base[k], err_msg=k)
    assert not any(np.array_equal(base[k], other_seed[k]) for k in common if base[k].std() > 0)


def test_unpaired_init_gives_each_variant_its_own_draw_and_keeps_the_data_order():
    paired = sweep_lib.load("configs/main.py:seeds=2,steps=10")
    unpaired = sweep_lib.load("configs/main.py:seeds=2,steps=10", ["sweep.paired_init=false"])
    seeds = {m.name: m.config.train.seed for m in unpaired.members}
    assert len(set(seeds.values())) == len(seeds)  # no two members share a draw
    for p, u in zip(paired.members, unpaired.members, strict=True):
        assert (p.name, p.seed, p.config.data) == (u.name, u.seed, u.config.data)
    params = {}
    for name in ("diff__seed0", "transformer__seed0"):
        cfg = next(m.config for m in unpaired.members if m.name == name)
        state = make_init(cfg, make_optimizer(cfg.optim, cfg.train.steps))(np.uint32(cfg.train.seed))
        params[name] = {jax.tree_util.keystr(p): np.asarray(v)
                        for p, v in jax.tree_util.tree_flatten_with_path(state.params)[0]}
    diff, base = params["diff__seed0"], params["transformer__seed0"]
    common = [k for k in base if k in diff and base[k].std() > 0]
    assert common and not any(np.array_equal(diff[k], base[k]) for k in common)
