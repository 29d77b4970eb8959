-- eindecomp_sql: stored tensors as element rows in plain DuckDB SQL (no Python, no extension).
--
-- Paste this whole file into any DuckDB session (the CLI, another language's client) that has
-- a database written by eindecomp_sql attached, then:
--
--     SELECT * FROM eds_elements('A');            -- index BIGINT[], value DOUBLE, raw BLOB
--     SELECT index[1] AS i, index[2] AS j, value FROM eds_elements('A');
--     SELECT index, eds_int64(raw) AS v FROM eds_elements('counts');   -- exact int64 values
--
-- eds_elements(tensor) reads the tensor's shape, dtype and tile shape from the eds_catalog
-- table and its tiles from the table of that name (key columns in dimension order, then the
-- BLOB column "tile"). One row per element, in no particular order:
--   index  the element's coordinates, one BIGINT per dimension (zero-based, like numpy);
--   value  the element as DOUBLE: exact for float16, bfloat16, float32, float64, bool (0/1) and every integer of
--          magnitude below 2^53; NULL for complex tensors (decode raw instead);
--   raw    the element's own bytes, little-endian: decode them exactly with the scalar
--          macros below (eds_float16, eds_bfloat16, eds_float32, eds_float64, eds_int8 ... eds_uint64, eds_bool,
--          eds_complex64 / eds_complex128 giving {re, im}).
--
-- A tile is the raw C-order bytes of a dense sub-array, little-endian; DuckDB has no cast from
-- BLOB to numbers, so each element's bytes are sliced out of the tile (tile[a:b]), written as
-- hex, reversed into a "0x..." literal that casts to an unsigned integer holding
-- the raw bits, and those bits are turned into the number: two's complement for signed
-- integers, IEEE-754 sign / exponent / mantissa arithmetic for floats (subnormals, signed
-- zeros, infinities and NaN included; NaN payloads are not kept).
--
-- Needs DuckDB 1.3 or later (the `lambda p:` syntax); everything here is a TEMP macro of the
-- session that runs it, so nothing is written to the database file.

-- the unsigned integer whose bits are the little-endian bytes b (1, 2, 4 or 8 of them): hex()
-- writes the bytes in memory order, reverse() puts the last byte first (with each byte's two
-- hex digits swapped, undone by the nibble swap), and DuckDB casts '0x...' text to UBIGINT
CREATE OR REPLACE TEMP MACRO eds_nibble_swap(x) AS
  ((x & CAST(1085102592571150095 AS UBIGINT)) << 4) | ((x >> 4) & CAST(1085102592571150095 AS UBIGINT));
CREATE OR REPLACE TEMP MACRO eds_bits(b) AS
  eds_nibble_swap(CAST('0x' || reverse(hex(CAST(b AS BLOB))) AS UBIGINT));

-- IEEE-754 from raw bits u: sign, biased exponent e (all ones: inf or nan) and mantissa m of
-- mbits bits; subnormals (e = 0) have no implicit leading one. Every product below is an
-- integer of at most 53 bits times a power of two, so it is exact in DOUBLE.
CREATE OR REPLACE TEMP MACRO eds_ieee(negative, e, m, mbits, emax, bias) AS
  CASE WHEN negative THEN CAST(-1.0 AS DOUBLE) ELSE CAST(1.0 AS DOUBLE) END * CASE
    WHEN e = emax AND m = 0 THEN CAST('inf' AS DOUBLE)
    WHEN e = emax THEN CAST('nan' AS DOUBLE)
    WHEN e = 0 THEN CAST(m AS DOUBLE) * pow(CAST(2.0 AS DOUBLE), CAST(1 - bias - mbits AS DOUBLE))
    ELSE (CAST(m AS DOUBLE) + pow(CAST(2.0 AS DOUBLE), CAST(mbits AS DOUBLE)))
         * pow(CAST(2.0 AS DOUBLE), CAST(e - bias - mbits AS DOUBLE))
  END;

-- decoders of raw bits u (an unsigned integer), one per dtype
CREATE OR REPLACE TEMP MACRO eds_float64_bits(u) AS
  eds_ieee(u >= CAST(9223372036854775808 AS UBIGINT), CAST((u >> 52) & 2047 AS BIGINT),
           CAST(u & 4503599627370495 AS BIGINT), 52, 2047, 1023);
CREATE OR REPLACE TEMP MACRO eds_float32_bits(u) AS
  CAST(eds_ieee(u >= 2147483648, CAST((u >> 23) & 255 AS BIGINT), CAST(u & 8388607 AS BIGINT), 23, 255, 127)
       AS FLOAT);
CREATE OR REPLACE TEMP MACRO eds_float16_bits(u) AS
  CAST(eds_ieee(u >= 32768, CAST((u >> 10) & 31 AS BIGINT), CAST(u & 1023 AS BIGINT), 10, 31, 15) AS FLOAT);
-- bfloat16 is float32's top half: float32's exponent, 7 mantissa bits
CREATE OR REPLACE TEMP MACRO eds_bfloat16_bits(u) AS
  CAST(eds_ieee(u >= 32768, CAST((u >> 7) & 255 AS BIGINT), CAST(u & 127 AS BIGINT), 7, 255, 127) AS FLOAT);
-- two's complement: n-bit patterns at or above 2^(n-1) stand for u - 2^n
CREATE OR REPLACE TEMP MACRO eds_signed_bits(u, n) AS
  CASE WHEN CAST(u AS HUGEINT) >= CAST(pow(2, n - 1) AS HUGEINT)
       THEN CAST(u AS HUGEINT) - CAST(pow(2, n) AS HUGEINT) ELSE CAST(u AS HUGEINT) END;

-- decoders of one element's little-endian bytes b, exact in DuckDB's type for each dtype
CREATE OR REPLACE TEMP MACRO eds_float64(b) AS eds_float64_bits(eds_bits(b));
CREATE OR REPLACE TEMP MACRO eds_float32(b) AS eds_float32_bits(eds_bits(b));
CREATE OR REPLACE TEMP MACRO eds_float16(b) AS eds_float16_bits(eds_bits(b));
CREATE OR REPLACE TEMP MACRO eds_bfloat16(b) AS eds_bfloat16_bits(eds_bits(b));
CREATE OR REPLACE TEMP MACRO eds_int8(b) AS CAST(eds_signed_bits(eds_bits(b), 8) AS TINYINT);
CREATE OR REPLACE TEMP MACRO eds_int16(b) AS CAST(eds_signed_bits(eds_bits(b), 16) AS SMALLINT);
CREATE OR REPLACE TEMP MACRO eds_int32(b) AS CAST(eds_signed_bits(eds_bits(b), 32) AS INTEGER);
CREATE OR REPLACE TEMP MACRO eds_int64(b) AS CAST(eds_signed_bits(eds_bits(b), 64) AS BIGINT);
CREATE OR REPLACE TEMP MACRO eds_uint8(b) AS CAST(eds_bits(b) AS UTINYINT);
CREATE OR REPLACE TEMP MACRO eds_uint16(b) AS CAST(eds_bits(b) AS USMALLINT);
CREATE OR REPLACE TEMP MACRO eds_uint32(b) AS CAST(eds_bits(b) AS UINTEGER);
CREATE OR REPLACE TEMP MACRO eds_uint64(b) AS eds_bits(b);
CREATE OR REPLACE TEMP MACRO eds_bool(b) AS eds_bits(b) <> 0;
CREATE OR REPLACE TEMP MACRO eds_complex64(b) AS {'re': eds_float32(b[1:4]), 'im': eds_float32(b[5:8])};
CREATE OR REPLACE TEMP MACRO eds_complex128(b) AS {'re': eds_float64(b[1:8]), 'im': eds_float64(b[9:16])};

-- bytes per element of each dtype eindecomp_sql stores
CREATE OR REPLACE TEMP MACRO eds_itemsize(dtype) AS
  CASE dtype
    WHEN 'bool' THEN 1 WHEN 'int8' THEN 1 WHEN 'uint8' THEN 1
    WHEN 'int16' THEN 2 WHEN 'uint16' THEN 2 WHEN 'float16' THEN 2 WHEN 'bfloat16' THEN 2
    WHEN 'int32' THEN 4 WHEN 'uint32' THEN 4 WHEN 'float32' THEN 4
    WHEN 'int64' THEN 8 WHEN 'uint64' THEN 8 WHEN 'float64' THEN 8 WHEN 'complex64' THEN 8
    WHEN 'complex128' THEN 16
  END;

-- an element's raw bits u as DOUBLE (NULL for complex)
CREATE OR REPLACE TEMP MACRO eds_double_bits(u, dtype) AS
  CASE dtype
    WHEN 'float64' THEN eds_float64_bits(u)
    WHEN 'float32' THEN CAST(eds_float32_bits(u) AS DOUBLE)
    WHEN 'float16' THEN CAST(eds_float16_bits(u) AS DOUBLE)
    WHEN 'bfloat16' THEN CAST(eds_bfloat16_bits(u) AS DOUBLE)
    WHEN 'bool' THEN CAST(u <> 0 AS DOUBLE)
    WHEN 'int8' THEN CAST(eds_signed_bits(u, 8) AS DOUBLE)
    WHEN 'int16' THEN CAST(eds_signed_bits(u, 16) AS DOUBLE)
    WHEN 'int32' THEN CAST(eds_signed_bits(u, 32) AS DOUBLE)
    WHEN 'int64' THEN CAST(eds_signed_bits(u, 64) AS DOUBLE)
    WHEN 'uint8' THEN CAST(u AS DOUBLE) WHEN 'uint16' THEN CAST(u AS DOUBLE)
    WHEN 'uint32' THEN CAST(u AS DOUBLE) WHEN 'uint64' THEN CAST(u AS DOUBLE)
  END;

-- Element rows. A tile with keys k covers [k*t, min((k+1)*t, n)) of each dimension (edge tiles
-- are smaller); its elements are in C order, so element `off` of a tile of extents x sits at
-- coordinate k*t + (off // (product of the later extents)) % x in each dimension. Each step is
-- its own CTE so the bytes and bits of an element are computed once, not once per use.
CREATE OR REPLACE TEMP MACRO eds_elements(tensor) AS TABLE
WITH info AS (
  SELECT shape, tile AS tshape, dtype, eds_itemsize(dtype) AS itemsize
  FROM eds_catalog WHERE lower(eds_catalog.name) = lower(tensor)
),
tiles AS (
  SELECT list_value(*COLUMNS(* EXCLUDE (tile))) AS k, tile AS bytes FROM query_table(tensor)
),
extents AS (
  SELECT k, bytes, dtype, itemsize, shape, tshape,
         list_transform(range(1, len(shape) + 1),
                        lambda p: least(tshape[p], shape[p] - k[p] * tshape[p])) AS ext
  FROM tiles, info
),
strides AS (
  SELECT *, list_transform(range(1, len(shape) + 1),
                           lambda p: CAST(coalesce(list_product(ext[p + 1:]), 1) AS BIGINT)) AS stride
  FROM extents
),
cells AS (
  SELECT k, tshape, ext, stride, dtype, itemsize, bytes,
         unnest(range(octet_length(bytes) // itemsize)) AS off
  FROM strides
),
raws AS (
  SELECT k, tshape, ext, stride, dtype, off, bytes[off * itemsize + 1:(off + 1) * itemsize] AS raw FROM cells
),
bits AS (
  SELECT *, CASE WHEN octet_length(raw) <= 8 THEN eds_bits(raw) END AS u FROM raws
)
SELECT list_transform(range(1, len(k) + 1),
                      lambda p: k[p] * tshape[p] + (off // stride[p]) % ext[p]) AS index,
       eds_double_bits(u, dtype) AS value,
       raw
FROM bits;
