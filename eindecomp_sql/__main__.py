"""``python -m eindecomp_sql ...``: the ``eindecomp-sql`` command line (eindecomp_sql/cli.py)."""

from .cli import main

if __name__ == "__main__":
    main()
