-- The SQL interface: einsum(spec, a, ...), einsum_elements(spec, a, ...) and
-- einsum_topk(spec, k, a, ...) as table macros. DuckDB 2.0 does not overload table macros by
-- arity, so operands 2..8 are defaulted to NULL; join := and agg := name the extended
-- notation's join function and aggregation ("join" is quoted: JOIN is a keyword, yet callers
-- may write join := 'add'); einsum_topk's largest := false ranks the smallest first. Every
-- argument is cast to VARCHAR here, so a wrong type reaches eds_einsum_sql (a Python UDF) and
-- gets our message instead of a binder error naming it.
-- eds_einsum_sql resolves the operands (stored tensors or ordinary tables), plans the einsum
-- and returns the whole plan as one query for query(). The caller's default database and schema
-- go along: the plan is made on the session's own cursor, whose default is the session's database,
-- so a caller that switched away (USE other) is refused rather than served another table's rows.
CREATE OR REPLACE TEMP MACRO {macro}(spec, {k_param}o0, o1 := NULL, o2 := NULL, o3 := NULL, o4 := NULL, o5 := NULL, o6 := NULL, o7 := NULL, "join" := NULL, agg := NULL{more_params}) AS TABLE
SELECT * FROM query(eds_einsum_sql(CAST(spec AS VARCHAR), [CAST(o0 AS VARCHAR), CAST(o1 AS VARCHAR), CAST(o2 AS VARCHAR), CAST(o3 AS VARCHAR), CAST(o4 AS VARCHAR), CAST(o5 AS VARCHAR), CAST(o6 AS VARCHAR), CAST(o7 AS VARCHAR)], {mode}, CAST("join" AS VARCHAR), CAST(agg AS VARCHAR), {k_arg}, [current_database(), current_schema()]))
