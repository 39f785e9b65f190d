"""Which model a budget buys: a scaling law fitted on the user's own data, and the ladder of runs that measures it.

    law.py      L(N, D) = E + A / N^alpha + B / D^beta: fitted (Huber, bootstrap), predicted, written and read as JSON
    family.py   one family of shapes set by depth (width --aspect a block, muP over depth 1), the parameters a law counts
    design.py   which depths a budget trains where the law's form applies, each to one compute level
    isoflop.py  approach 2 (iso-FLOP profiles) on the ladder's points, beside the law's optimum
    ladder.py   `fitgpt ladder`: the design's depths trained under WSD, cooldown branches, the law fitted
    picture.py  the law drawn: the points, the fitted curves, the iso-FLOP profiles, the compute-optimal frontier
"""
