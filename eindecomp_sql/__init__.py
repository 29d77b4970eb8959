"""eindecomp_sql: extended einsum as tensor-relational SQL on embedded DuckDB.

>>> import numpy as np, eindecomp_sql as eds
>>> eds.einsum("ij,jk->ik", np.eye(2), np.ones((2, 2)))
array([[1., 1.],
       [1., 1.]])
"""

from .errors import EinsumError
from .graph import Graph
from .api import einsum
from .session import Session, connect
from .tensor import Tensor

__all__ = ["EinsumError", "Graph", "Session", "Tensor", "connect", "einsum"]
__version__ = "0.1.0"
