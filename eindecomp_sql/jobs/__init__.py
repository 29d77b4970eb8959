"""Jobs: a graph of named einsum steps written in a TOML file, planned as one graph, run step by
step with every step's result committed on its own, and resumed after a crash (docs/cli.md).

``spec`` reads and checks a job file (pure: no database, no engine); ``runner`` plans it,
fingerprints its parts against a database and runs what is not done; ``files`` reads and
writes tensor files (``.npy``, ``.parquet``, Arrow IPC).
"""

from .spec import FILE_SUFFIXES, InputSpec, Job, JobError, StepSpec, load_job, parse_job

__all__ = ["FILE_SUFFIXES", "InputSpec", "Job", "JobError", "StepSpec", "load_job", "parse_job"]
