-- One einsum step whose reduced labels are all in one piece: join the operands' tiled tables
-- on the keys of their shared labels; each joined row is exactly one output tile, so the tile
-- kernel runs once per row and nothing is grouped.
--   {out_keys}   key columns of the result, aliased to the result's key names
--   {kernel}     eds_einsum<arity>, {spec} its JSON description, {key_list} one key per label
SELECT {out_keys}{comma}{kernel}({spec}, {key_list}, {tiles}) AS tile
FROM {sources}
{where}
