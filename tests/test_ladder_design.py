"""The ladder's design (which depths a budget trains where the law's form applies, each to the same compute), the
law's own check that its points identify it, and approach 2 (iso-FLOP profiles) beside approach 3."""

import pytest
from test_budget import DATA, TRUE

from fitgpt.errors import UserError
from fitgpt.scaling import design
from fitgpt.scaling.isoflop import iso_flop
from fitgpt.scaling.law import Coefficients, Law, fit_law

# The family's depths 1 to 5 on the tiny preset (vocabulary 2048): non-embedding and compute parameters, and the
# tokens/s this 2-core CPU measured for them (fp32, 16 x 128 a step), width 64 and 32 a block.
W64 = {1: (50_112, 181_184, 53_836), 2: (396_800, 658_944, 18_872), 3: (1_334_976, 1_728_192, 9_047),
       4: (3_159_552, 3_683_840, 4_073), 5: (6_165_440, 6_820_800, 2_516)}
W32 = {1: (12_768, 78_304, 68_059), 2: (100_096, 231_168, 46_932), 3: (335_712, 532_320, 20_631),
       4: (793_344, 1_055_488, 12_189), 5: (1_546_720, 1_874_400, 8_036)}


def test_the_tables_are_the_familys_own_counts():
    from fitgpt.model import ModelConfig
    from fitgpt.scaling.family import Family, compute_params, non_embedding_params

    base = ModelConfig(vocab_size=2048, context_length=128)
    for aspect, table in ((64, W64), (32, W32)):
        shapes = {d: Family(aspect).shape(d, base) for d in table}
        assert {d: (non_embedding_params(m), compute_params(m)) for d, m in shapes.items()} == \
            {d: v[:2] for d, v in table.items()}


def _probe(table, probed):
    def probe(depth):
        probed.append(depth)
        return design.Candidate(depth, *table[depth])
    return probe


def test_a_budget_keeps_the_depths_whose_every_point_sees_enough_tokens_a_parameter_each_to_one_compute():
    probed = []
    chosen = design.plan(_probe(W32, probed), [1, 2, 3, 4, 5], 1000.0, lambda s: s)
    assert [c.depth for c in chosen.depths] == [1, 2, 3]  # depth 4 would leave depth 2 under 100 tokens a parameter
    assert probed == [1, 2, 3, 4]  # depth 5 is not timed: past a depth that does not fit, none does
    lowest = [design.LOWEST * c.tokens(chosen.flops) / c.n_params for c in chosen.depths]
    assert min(lowest) >= design.MIN_TOKENS_PER_PARAM and lowest[-1] == min(lowest)
    assert chosen.depths[1].tokens(chosen.flops) >= design.SATURATED_TOKENS_PER_PARAM * chosen.depths[1].n_params
    assert sum(c.seconds(chosen.flops) for c in chosen.depths) == pytest.approx(1000.0)
    # every depth to one compute level: its FLOPs are 6 x its compute parameters x its tokens
    assert {round(6 * c.compute_params * c.tokens(chosen.flops)) for c in chosen.depths} == {round(chosen.flops)}
    assert chosen.share(chosen.depths[0]) == pytest.approx(chosen.depths[0].seconds(chosen.flops) / 1000.0)


@pytest.mark.parametrize("table,seconds,kept", [(W64, 200.0, 1), (W32, 700.0, 2)])
def test_a_budget_that_cannot_identify_a_law_is_refused_naming_the_budget_that_would(table, seconds, kept):
    """In 200 s of steps width 64 cannot give depth 2 100 tokens a parameter; in 700 s width 32 can, but not with
    depth 3 beside it, and depths 1 and 2 span 7.8x. The budget that gives depths 1 to 3 their tokens is said
    (at the throughput just measured, through the ladder's own reckoning: here doubled), and nothing past depth 3 is
    timed."""
    probed = []
    with pytest.raises(UserError, match=rf"past depth {kept} .*a law needs 10x\).* depths 1 to 3 need --time-budget "
                                        r"(\d+\.\d)[mh] at the throughput measured now, or --aspect 32$") as e:
        design.plan(_probe(table, probed), [1, 2, 3, 4, 5], seconds, lambda s: 2 * s, hint=", or --aspect 32")
    assert probed == [1, 2, 3]
    said = e.value.args[0].split("--time-budget ")[1].split(" ")[0]
    need = float(said[:-1]) * {"m": 60, "h": 3600}[said[-1]] / 2  # to_budget doubled it
    again = design.plan(_probe(table, []), [1, 2, 3], need * 1.01, lambda s: s)
    assert [c.depth for c in again.depths] == [1, 2, 3]


def test_depths_that_span_under_a_decade_are_refused_naming_the_flag():
    with pytest.raises(UserError, match="--depths 1 2 span 7.9x in parameters; a law needs 10x: add larger --depths"):
        design.plan(_probe(W64, []), [1, 2], 1e6, lambda s: s)


def _law(coefficients, points=None):
    points = points or [{"n_params": 1e5, "tokens": 1e6, "val_loss": 3.0}, {"n_params": 1e6, "tokens": 1e6, "val_loss": 2.5}]
    return Law(coefficients, points, [0.0] * len(points), [], DATA)


@pytest.mark.parametrize("c,needle", [
    (Coefficients(E=0.007, A=4.5e-5, alpha=0.3, B=20.6, beta=0.114), "E 0.007 at zero"),
    (Coefficients(E=2.499, A=1.0, alpha=0.3, B=20.6, beta=0.114), "at the best measured loss 2.500"),
    (Coefficients(E=1.0, A=1.0, alpha=3.0, B=20.6, beta=0.114), "alpha 3.000 on its bound"),
    (Coefficients(E=1.0, A=1.0, alpha=0.3, B=20.6, beta=0.01), "beta 0.010 on its bound"),
])
def test_a_law_its_points_do_not_identify_says_why(c, needle):
    assert any(needle in p for p in _law(c).problems()), _law(c).problems()


def test_a_law_of_plausible_coefficients_has_no_problems():
    assert _law(TRUE).problems() == []


def _trained(ends: dict[int, float], quarter: float) -> list[dict]:
    """A ladder's points at depths 1 to 3 (width 32 a block): each depth's end at ``ends[depth]`` tokens a parameter,
    depth 3's first branch at ``quarter``."""
    n = {d: W32[d][0] for d in (1, 2, 3)}
    points = [{"depth": d, "n_params": n[d], "tokens": r * n[d], "how": "end"} for d, r in ends.items()]
    return points + [{"depth": 3, "n_params": n[3], "tokens": quarter * n[3], "how": "cooldown from step 272"}]


def test_a_ladder_whose_runs_fell_short_of_its_design_says_which_and_by_how_much():
    """The points of three 28-minute ladders of RESULTS: depth 2 ended at 88.6 and 78.4 tokens a parameter (within
    REACHED of the design's 100), and their laws agree; beside other work, at 24, and its law moved (E 2.90 to
    3.46)."""
    assert design.shortfalls(_trained({1: 3248.4, 2: 88.6, 3: 9.7}, 2.1)) == []
    assert design.shortfalls(_trained({1: 2476.3, 2: 78.4, 3: 11.8}, 2.5)) == []
    assert design.shortfalls(_trained({1: 804.3, 2: 24.1, 3: 10.1}, 4.2)) == [
        "depth 2 ended at 24.1 tokens a parameter, under the design's 100"]
    assert design.shortfalls(_trained({1: 804.3, 2: 124.1, 3: 1.0}, 0.2)) == [
        "depth 3's cooldown from step 272 at 0.2 tokens a parameter, under the design's 0.5"]


def _design_points():
    """A design's points under TRUE: four sizes, each to 1e15 FLOPs and its branches to a quarter and a half (compute
    parameters: the non-embedding ones and a head of 2048 x a width that grows as their cube root)."""
    sizes = (5e4, 2e5, 8e5, 3.2e6)
    points = []
    for n in sizes:
        for f in (0.25, 0.5, 1.0):
            flops = 1e15 * f
            tokens = flops / (6 * _compute(n))
            points.append({"n_params": n, "tokens": tokens, "flops": flops, "val_loss": float(TRUE.loss(n, tokens))})
    return points


def _compute(n):
    return n + 2048 * 64 * (n / 5e4) ** (1 / 3)


def test_the_iso_flop_profiles_find_the_laws_own_optimum():
    points = _design_points()
    law = Law(TRUE, points, [0.0] * len(points), [], {**DATA, "unique_tokens": 10**12})
    iso = iso_flop(law, _compute)
    assert [round(lv["flops"] / 1e15, 2) for lv in iso["levels"]] == [0.25, 0.5, 1.0]
    for lv in iso["levels"]:
        assert len(lv["n_params"]) == 4 and lv["n_opt"] is not None
        # a parabola in log N through four sizes 4x apart: the law's own optimum within 5%
        assert lv["n_opt"] == pytest.approx(lv["n_opt_law"], rel=0.05), lv
    assert iso["exponent"] == pytest.approx(iso["exponent_law"], abs=0.02)  # 0.421 and 0.412


@pytest.mark.slow
def test_a_law_fitted_on_a_designs_points_is_identified_and_finds_its_coefficients():
    points = _design_points()
    law = fit_law(points, {**DATA, "unique_tokens": 10**12}, {}, resamples=5)
    assert law.problems() == []
    assert law.coefficients.alpha == pytest.approx(TRUE.alpha, rel=0.05)
    assert law.coefficients.E == pytest.approx(TRUE.E, rel=0.05)
