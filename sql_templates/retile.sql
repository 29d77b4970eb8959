-- Re-tile a tiled table the memory-efficient way: (1) every source tile is paired with the
-- target tiles it overlaps, by key arithmetic alone (unnest(range(lo, hi)) per dimension);
-- (2) a kernel slices out just the overlapping piece; (3) the pieces of each target tile are
-- grouped and concatenated. No step holds more than one target tile and its pieces.
SELECT {new_keys}, eds_assemble({spec}, {new_key_list}, list({piece_struct})) AS tile
FROM (
  SELECT {new_keys}, {old_keys}, eds_slice({spec}, {slice_key_list}, tile) AS piece
  FROM {overlaps}
) AS pieces
GROUP BY {new_keys}
