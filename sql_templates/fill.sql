-- A result that reads no input (an einsum over a label of size 0): one row per tile of the
-- result's grid, from a cross product of key ranges (none when a dimension has size 0); the
-- kernel writes each tile full of one value, the aggregation's identity.
--   {keys}  the result's key columns, {spec} the kernel's JSON, {key_list} the keys as a list
SELECT {keys}{comma}eds_fill({spec}, {key_list}) AS tile
{ranges}
