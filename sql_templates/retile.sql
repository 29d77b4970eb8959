-- Re-tile a tiled table the memory-efficient way (slice, regroup, concatenate):
-- (1) one kernel call per source tile cuts it into the pieces that fall in each target tile,
--     so a source tile crosses into the kernel once, however many targets it feeds;
-- (2) unnest() turns the pieces into rows keyed by their target tile;
-- (3) the pieces of each target tile are grouped and concatenated.
-- No step holds more than the source tiles of one vector and the pieces of its targets; a
-- batched retile restricts both to a range of the first target key.
SELECT {new_keys}, eds_assemble({spec}, {new_key_list}, list({piece_struct})) AS tile
FROM (
  SELECT {new_key_items}, cut.k AS old_k, cut.t AS piece
  FROM (SELECT unnest(eds_split({spec}, {old_key_list}, tile)) AS cut FROM {source} {source_where}) AS cuts
) AS pieces
GROUP BY {new_keys}
