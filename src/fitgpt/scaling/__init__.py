"""Which model a budget buys: a scaling law fitted on the user's own data, and the ladder of runs that measures it.

    law.py      L(N, D) = E + A / N^alpha + B / D^beta: fitted (Huber, bootstrap), predicted, written and read as JSON
    family.py   one family of shapes set by depth (width 64 a block), and the parameters a law counts
    ladder.py   `fitgpt ladder`: the family's small models trained under WSD, cooldown branches, the law fitted
    picture.py  the law drawn: the points, the fitted curves, the compute-optimal frontier
"""
