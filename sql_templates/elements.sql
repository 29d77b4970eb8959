-- Tiles to one row per element: a kernel turns each tile into a typed list of its values
-- (C order), unnest() walks it next to its offsets, and each element's coordinates come from
-- the tile key and the offset by key arithmetic.
SELECT {element_keys}value
FROM (
  SELECT {keys}{comma}unnest(vals) AS value, unnest(range(len(vals))) AS off
  FROM (SELECT {keys}{comma}{values_fn}(tile) AS vals FROM {source}) AS decoded
) AS cells
