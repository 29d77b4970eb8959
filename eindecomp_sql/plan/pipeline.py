"""The one planning pipeline: single einsums and graphs alike become a ``Draft`` (nodes over
values) and go through ``PASSES`` in order.

>>> from eindecomp_sql.plan.draft import example
>>> [s.describe() for s in run_passes(example("ij,jk->ik", (8, 6), (6, 5))).plan().steps]
['einsum ij,jk->ik [i:1 j:1 k:1] -> _eds_result']
"""

from __future__ import annotations

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

PASSES = (fill_empty, fuse_chains, choose_chunking, insert_retiles, fuse_elementwise, fuse_programs, split_reductions, split_batches,
          check_budget)


def run_passes(draft: Draft, passes=PASSES) -> Draft:
    for p in passes:
        draft = p(draft)
    return draft
