-- A table with a fixed-size array column as a tiled (rows x n) matrix, inside the einsum's
-- query: row r is the r-th in key order. Rows are numbered on the keys alone (a window that
-- carried the arrays along took ~2x as long), joined back, grouped into tiles of {t0} whole
-- rows, and a kernel packs each group's arrays, listed in row order, into one tile's bytes.
-- With one tile of rows ({single}) the numbering is skipped: one list of arrays in key order.
SELECT {tile_key} AS {k0}, CAST(0 AS BIGINT) AS {k1},
       {kernel}({spec}, CAST([{tile_key}, 0] AS BIGINT[]), list(CAST({column} AS {list_type}) ORDER BY {order})) AS tile
FROM {source}
{numbered}
{group_by}
