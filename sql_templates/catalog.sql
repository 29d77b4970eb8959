-- The catalog: shape, dtype, tile shape and key column names of every stored tensor, kept in
-- the same database so a file database finds its tensors again after reopening.
CREATE TABLE IF NOT EXISTS eds_catalog (
  name VARCHAR PRIMARY KEY,
  shape BIGINT[] NOT NULL,
  dtype VARCHAR NOT NULL,
  tile BIGINT[] NOT NULL,
  keys VARCHAR[] NOT NULL
)
