"""The one planning pipeline: single einsums and graphs alike become a ``Draft`` (nodes over
values) and go through ``PASSES`` in order.

>>> from eindecomp_sql.plan.draft import example
>>> [s.describe() for s in run_passes(example("ij,jk->ik", (8, 6), (6, 5))).plan().steps]
['einsum ij,jk->ik [i:1 j:1 k:1] -> _eds_result']
"""

from __future__ import annotations

from dataclasses import replace

from ..errors import EinsumError
from .draft import Draft
from .passes.batches import split_batches
from .passes.budget import check_budget
from .passes.chains import fuse_chains
from .passes.chunking import choose_chunking
from .passes.fill_empty import fill_empty
from .passes.fuse import fuse_elementwise
from .passes.program import fuse_programs
from .passes.reductions import split_reductions
from .passes.retiles import insert_retiles
from .steps import OverBudget

PASSES = (fill_empty, fuse_chains, choose_chunking, insert_retiles, fuse_elementwise, fuse_programs, split_reductions, split_batches,
          check_budget)


# the shares of the budget the optimizer is asked to plan under again when its plan came out
# over the budget (``run_passes``)
RETRY_SHARES = (3 / 4, 1 / 2, 1 / 4)


def run_passes(draft: Draft, passes=PASSES) -> Draft:
    """``draft`` through ``passes``. The optimizer sees a re-tile's target tiles, not its source
    (docs/DESIGN.md, Known limits), so a finished plan may come out over the budget where a
    finer chunking fits: a trial's job planned under 50 MB and 60 MB, not under 40 MB or 70 MB
    ("retile b (1000, 1700) -> (2000, 425) in 4 batches would need 81.6 MB"). Such a plan is
    made again with the optimizer under a smaller share of the budget, the rest of the passes
    and the final check under the whole budget; the first that fits is taken."""
    try:
        return _run(draft, passes)
    except OverBudget as over:
        o = draft.options
        if o.budget is None or o.chunking_budget is not None or choose_chunking not in passes:
            raise
        for share in RETRY_SHARES:
            try:
                return _run(replace(draft, options=replace(o, chunking_budget=int(o.budget * share))), passes)
            except OverBudget:
                continue
            except EinsumError:  # nothing fits the optimizer there: less will not either
                break
        raise over from None


def _run(draft: Draft, passes) -> Draft:
    for p in passes:
        draft = p(draft)
    return draft
