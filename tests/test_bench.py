"""The benchmark harness's verdict lines (bench/suite.py)."""


def test_ratio_verdict_says_which_side_of_the_ideal():
    from transnormer.bench.suite import ratio_verdict

    assert ratio_verdict("x", "t2-lm", "vanilla-lm", 1.05, 1.0).startswith("PASS")
    ahead = ratio_verdict("x", "t2-lm", "vanilla-lm", 2.0, 1.5)
    assert ahead.startswith("FAIL") and "t2-lm ahead of its FLOP ratio" in ahead and "vanilla-lm runs" in ahead
    behind = ratio_verdict("x", "t2-lm", "vanilla-lm", 0.8, 1.0)
    assert behind.startswith("FAIL") and "behind" in behind
