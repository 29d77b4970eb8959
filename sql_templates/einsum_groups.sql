-- One einsum step with a reduced label cut into several pieces: join the tiled tables, then
-- group the joined rows by the output keys and hand each whole group to the kernel, which
-- contracts and aggregates it in one call. Grouping the inputs (not partial results) means
-- partial products never travel back through DuckDB. One list() of structs keeps each row's
-- tiles together with the keys of its reduced labels.
SELECT {out_keys}{comma}{kernel}({spec}, {group_key_list}, list({member})) AS tile
FROM (
  SELECT {joined_columns}
  FROM {sources}
  {where}
) AS joined
{group_by}
