-- A table with a fixed-size array column as a tiled (rows x n) matrix, inside the einsum's
-- query: rows are numbered in key order, grouped into tiles of {t0} whole rows, and a kernel
-- packs each group's arrays into one tile's bytes.
SELECT {k0}, CAST(0 AS BIGINT) AS {k1}, {kernel}({spec}, CAST([{k0}, 0] AS BIGINT[]), list({{'o': o, 'a': a}})) AS tile
FROM (
  SELECT r // {t0} AS {k0}, r % {t0} AS o, CAST({column} AS {list_type}) AS a
  FROM (SELECT row_number() OVER (ORDER BY {key}) - 1 AS r, {column} FROM {source}) AS numbered
) AS cells
GROUP BY {k0}
