-- The SQL interface: einsum(spec, a, ...) and einsum_elements(spec, a, ...) as table macros.
-- DuckDB 2.0 does not overload table macros by arity, so operands 2..8 are defaulted to NULL;
-- eds_einsum_sql (a Python UDF) plans the einsum over the stored tensors it names and returns
-- the whole plan as one query for query().
CREATE OR REPLACE TEMP MACRO {macro}(spec, o0, o1 := NULL, o2 := NULL, o3 := NULL, o4 := NULL, o5 := NULL, o6 := NULL, o7 := NULL) AS TABLE
SELECT * FROM query(eds_einsum_sql(spec, [o0, o1, o2, o3, o4, o5, o6, o7], {mode}))
