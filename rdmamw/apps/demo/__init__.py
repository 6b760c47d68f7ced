"""``rdmamw demo``: a numpy MLP trained on scikit-learn's digits by workers and
servers of :mod:`rdmamw.ps`, one run per consistency model, compared in a table and a
plot (docs/ps.md)."""
