-- The k largest elements of every row of an einsum's result (a row: every output label but the
-- last, which is ranked). The kernel cuts each result tile to its top k per row (candidates
-- {{r: row number, i: index of the last label, v: value}}); a window ranks the candidates of a
-- row across tiles: value descending, NaN last, ties by the smaller index.
--   {candidates}  the kernel over the result tiles, or (fused: the einsum kernel already
--                 returned candidates, values as DOUBLE) the column itself; {value} casts back
SELECT {row_cols}"rank", i AS {last}, {value} AS "value"
FROM (
  SELECT cand.r AS r, cand.i AS i, cand.v AS v,
         row_number() OVER (PARTITION BY cand.r ORDER BY {nan_last}{order_value} DESC, cand.i) AS "rank"
  FROM (SELECT unnest({candidates}) AS cand FROM {source}) AS cands
) AS ranked
WHERE "rank" <= {k}
ORDER BY r, "rank"
