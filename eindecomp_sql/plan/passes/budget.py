"""Pass: refuse, before anything runs, a plan with a step whose projected peak exceeds the budget.

>>> from dataclasses import replace
>>> from eindecomp_sql.plan.pipeline import run_passes
>>> from eindecomp_sql.plan.draft import example
>>> d = run_passes(example("ij->ji", (2000, 2000)))     # planned without a budget: one step
>>> check_budget(replace(d, options=replace(d.options, budget=1_000_000)))  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
eindecomp_sql.plan.steps.OverBudget: step 0 (einsum ij->ji [i:1 j:1] -> _eds_result) would need ... MB, over the memory budget of 1.0 MB; ...
"""

from __future__ import annotations

from ..draft import Draft


def check_budget(d: Draft) -> Draft:
    d.plan().check_budget(d.options.budget)
    return d
