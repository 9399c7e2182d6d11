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
    assert one.cells("diff").split(" | ") == ["1", "-1.0000", "-1.0000", "—", "—",
                                              "1 paired seed(s), too few to compare"]
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
