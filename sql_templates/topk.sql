-- The k largest elements of every row of an einsum's result (a row: every output label but the
-- last, which is ranked). The kernel cuts each result tile to its top k per row (candidates
-- {{r: row number, i: index of the last label, v: value}}); a window ranks the candidates of a
-- row across tiles: value descending, NaN last, ties by the smaller index.
--   {candidates}  the kernel over the result tiles, or (fused: the einsum kernel already
--                 returned candidates, values as DOUBLE) the column itself; {value} casts back
-- (inner columns are _eds_*: an output label named r, i or v must not capture them)
SELECT {row_cols}"rank", _eds_i AS {last}, {value} AS "value"
FROM (
  SELECT cand.r AS _eds_r, cand.i AS _eds_i, cand.v AS _eds_v,
         row_number() OVER (PARTITION BY cand.r ORDER BY {nan_last}{order_value} DESC, cand.i) AS "rank"
  FROM (SELECT unnest({candidates}) AS cand FROM {source}) AS cands
) AS ranked
WHERE "rank" <= {k}
ORDER BY _eds_r, "rank"
