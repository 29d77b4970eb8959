-- An ordinary table in element form (index columns + value) as a tiled table, inside the
-- einsum's query: element rows are grouped by tile key (index // tile side) and a kernel packs
-- each group into one tile's bytes (offset = the element's C-order position in a full tile).
-- Every tile of the grid is produced, empty ones too (zeros): a missing tile would drop out of
-- the einsum's join. An index outside the planned shape stops the query (error()).
--   {grid}       the grid of tile keys (a cross product of range()s), {join_on} keys equal
--   {kernel}     eds_pack_<dtype>, {spec} its JSON description, {member_type} its element list type
SELECT {out_keys}{kernel}({spec}, {key_list}, coalesce(e.m, CAST([] AS {member_type}))) AS tile
FROM {grid} AS g
FULL OUTER JOIN (
  SELECT {keys}{comma}list({{'o': o, 'v': v}}) AS m
  FROM (SELECT {tile_keys}{offset} AS o, {value} AS v FROM {source}) AS cells
  {group_by}
) AS e ON {join_on}
