-- adbc, Postgres: table
"public"."outbox"

-- adbc, Postgres: dead_table
"public"."outbox_dead_letters"

-- adbc, Postgres: now
(now() AT TIME ZONE 'UTC')

-- adbc, Postgres: id_expr
(o."sequence_id")::int8

-- adbc, Postgres: key_expr
(o."channel")::text

-- adbc, Postgres: select_list
(o."sequence_id")::int8, NULL::text, (o."channel")::text, NULL::text, (o."name")::text, (o."data")::text, (o."headers")::text, (o."mutation_id")::text, (CASE WHEN o."rejected" THEN 1 ELSE 0 END)::int8, NULL::int8, NULL::int8, NULL::int8, NULL::text, NULL::text

-- adbc, Postgres: pending
o."processed" = false

-- adbc, Postgres: dead
o."processed" = true

-- adbc, Postgres: delivered
(none)

-- adbc, Postgres: claimable
o."processed" = false AND (o."lock_expiry" IS NULL OR o."lock_expiry" < (now() AT TIME ZONE 'UTC'))

-- adbc, Postgres: order_by
o."sequence_id"

-- adbc, Postgres: claim_set
"locked_by" = $node, "lock_expiry" = (now() AT TIME ZONE 'UTC') + $lease::int8 * interval '1 millisecond'

-- adbc, Postgres: fence
o."locked_by" = $node

-- adbc, Postgres: ack
DELETE FROM "public"."outbox" o WHERE o."sequence_id" = ANY($ids) AND o."locked_by" = $node

-- adbc, Postgres: retry_set
"locked_by" = NULL, "lock_expiry" = NULL

-- adbc, Postgres: dead_set
"processed" = true, "locked_by" = NULL, "lock_expiry" = NULL

-- adbc, Postgres: release
UPDATE "public"."outbox" o SET "locked_by" = NULL, "lock_expiry" = NULL WHERE o."sequence_id" = ANY($ids) AND o."locked_by" = $node

-- adbc, Postgres: release unheld
UPDATE "public"."outbox" o SET "locked_by" = NULL, "lock_expiry" = NULL WHERE o."locked_by" IS NOT NULL AND o."locked_by" = $node AND :not_held

-- adbc, Postgres: extend
UPDATE "public"."outbox" o SET "lock_expiry" = (now() AT TIME ZONE 'UTC') + $lease::int8 * interval '1 millisecond' WHERE o."sequence_id" = ANY($ids) AND o."locked_by" = $node AND $lease >= 0

-- adbc, Postgres: reap to pending
UPDATE "public"."outbox" o SET "locked_by" = NULL, "lock_expiry" = NULL WHERE o."locked_by" IS NOT NULL AND (:all OR o."lock_expiry" < (now() AT TIME ZONE 'UTC')) AND :max IS NOT NULL AND $lease >= 0

-- adbc, Postgres: reap to dead
(none)

-- adbc, Postgres: stats
SELECT (coalesce(sum(CASE WHEN o."processed" = false THEN 1 ELSE 0 END), 0))::int8, (coalesce(sum(CASE WHEN false THEN 1 ELSE 0 END), 0))::int8, (coalesce(sum(CASE WHEN o."processed" = true THEN 1 ELSE 0 END), 0))::int8, NULL::int8 FROM "public"."outbox" o WHERE (o."processed" = false) OR (o."processed" = true)

-- adbc, Postgres: stats by destination
SELECT (o."channel")::text, (coalesce(sum(CASE WHEN o."processed" = false THEN 1 ELSE 0 END), 0))::int8, (coalesce(sum(CASE WHEN false THEN 1 ELSE 0 END), 0))::int8, (coalesce(sum(CASE WHEN o."processed" = true THEN 1 ELSE 0 END), 0))::int8, NULL::int8 FROM "public"."outbox" o WHERE (o."processed" = false) OR (o."processed" = true) GROUP BY (o."channel")::text ORDER BY (o."channel")::text

-- adbc, Postgres: dead_list
SELECT (o."sequence_id")::text, NULL::text, (o."channel")::text, (o."name")::text, NULL::int8, NULL::text, NULL::int8 FROM "public"."outbox" o WHERE o."processed" = true AND :filter ORDER BY o."sequence_id" LIMIT $n

-- adbc, Postgres: event
SELECT (o."sequence_id")::int8, NULL::text, (o."channel")::text, NULL::text, (o."name")::text, (o."data")::text, (o."headers")::text, (o."mutation_id")::text, (CASE WHEN o."rejected" THEN 1 ELSE 0 END)::int8, NULL::int8, NULL::int8, NULL::int8, NULL::text, NULL::text, ((CASE WHEN o."processed" = true THEN 2 WHEN 1 = 0 THEN 1 ELSE 0 END))::int8, NULL::int8, NULL::text, NULL::int8 FROM "public"."outbox" o WHERE :condition

-- adbc, Postgres: dead_retry
UPDATE "public"."outbox" o SET "processed" = false, "locked_by" = NULL, "lock_expiry" = NULL WHERE (o."processed" = true) AND :condition

-- adbc, Postgres: destination_text
(o."channel")::text

-- adbc, Postgres: delivered_time
(none)

-- adbc, Postgres: dead_time
(none)

-- adbc, Postgres: created_at
(none)

-- adbc, Postgres: replay_set
"processed" = false

-- adbc, Postgres: dead_table_ddl
(none)

-- adbc, Postgres: ddl
DO $create_schema$ BEGIN IF to_regnamespace('"public"') IS NULL THEN CREATE SCHEMA "public"; END IF; END $create_schema$;
CREATE TABLE IF NOT EXISTS "public"."outbox" ( sequence_id serial PRIMARY KEY, mutation_id TEXT NOT NULL, channel TEXT NOT NULL, name TEXT NOT NULL, rejected boolean NOT NULL DEFAULT false, data JSONB, headers JSONB, locked_by TEXT, lock_expiry TIMESTAMP WITHOUT TIME ZONE, processed BOOLEAN NOT NULL DEFAULT false );
CREATE OR REPLACE FUNCTION "public"."outbox_notify"() RETURNS trigger AS $$ BEGIN PERFORM pg_notify('ably_adbc'::text, ''::text); RETURN NULL; EXCEPTION -- ensure this function can never throw an uncaught exception
 WHEN others THEN RAISE WARNING 'unexpected error in %s: %%', SQLERRM; RETURN NULL; END; $$ LANGUAGE plpgsql;
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_trigger WHERE tgname = 'outbox_trigger' AND tgrelid = '"public"."outbox"'::regclass) THEN
        CREATE TRIGGER "outbox_trigger" AFTER INSERT ON "public"."outbox" FOR EACH STATEMENT EXECUTE PROCEDURE "public"."outbox_notify"();
    END IF;
END
$$;


-- adbc, Postgres: grants
GRANT SELECT, UPDATE, DELETE ON "public"."outbox" TO "relay";
-- Operators (`dead purge`, `prune`) also need DELETE on "public"."outbox".


-- adbc, Postgres: claim_select
SELECT (o."sequence_id")::int8, NULL::text, (o."channel")::text, NULL::text, (o."name")::text, (o."data")::text, (o."headers")::text, (o."mutation_id")::text, (CASE WHEN o."rejected" THEN 1 ELSE 0 END)::int8, NULL::int8, NULL::int8, NULL::int8, NULL::text, NULL::text FROM "public"."outbox" o WHERE :condition ORDER BY o."sequence_id" LIMIT $n

-- adbc, Postgres: claim_select locking
SELECT (o."sequence_id")::int8, NULL::text, (o."channel")::text, NULL::text, (o."name")::text, (o."data")::text, (o."headers")::text, (o."mutation_id")::text, (CASE WHEN o."rejected" THEN 1 ELSE 0 END)::int8, NULL::int8, NULL::int8, NULL::int8, NULL::text, NULL::text FROM "public"."outbox" o WHERE :condition ORDER BY o."sequence_id" LIMIT $n FOR UPDATE SKIP LOCKED

-- adbc, Postgres: claim_and_mark
WITH l AS (SELECT o."sequence_id" AS id FROM "public"."outbox" o WHERE :condition
                         ORDER BY o."sequence_id" LIMIT $n FOR UPDATE SKIP LOCKED),
                  u AS (SELECT x.id, x.k, row_number() OVER () AS n
                          FROM (SELECT o."sequence_id" AS id, (o."channel")::text AS k FROM "public"."outbox" o WHERE :condition
                                 ORDER BY o."sequence_id" LIMIT $n) x),
                  passed AS (SELECT k, min(n) AS n FROM u
                              WHERE NOT EXISTS (SELECT 1 FROM l WHERE l.id = u.id) GROUP BY k),
                  c AS (SELECT u.id, u.n FROM u JOIN l ON l.id = u.id
                          LEFT JOIN passed ON passed.k IS NOT DISTINCT FROM u.k
                         WHERE passed.n IS NULL OR u.n < passed.n)
             UPDATE "public"."outbox" o SET "locked_by" = $node, "lock_expiry" = (now() AT TIME ZONE 'UTC') + $lease::int8 * interval '1 millisecond' FROM c
              WHERE o."sequence_id" = c.id AND $node IS NOT NULL AND $lease >= 0
             RETURNING (o."sequence_id")::int8, NULL::text, (o."channel")::text, NULL::text, (o."name")::text, (o."data")::text, (o."headers")::text, (o."mutation_id")::text, (CASE WHEN o."rejected" THEN 1 ELSE 0 END)::int8, NULL::int8, NULL::int8, NULL::int8, NULL::text, NULL::text, c.n

-- adbc, Postgres: claim_order_column
14

-- adbc, Postgres: at_micros
(to_timestamp(:micros::float8 / 1e6) AT TIME ZONE 'UTC')

-- adbc, Postgres: destination_is
(o."channel")::text = :destination

-- adbc, Postgres: delivered_between
(none)

-- adbc, Postgres: delivered_before
(none)

-- adbc, Postgres: dead_before
(none)

-- adbc, Postgres: release_unheld
UPDATE "public"."outbox" o SET "locked_by" = NULL, "lock_expiry" = NULL WHERE o."locked_by" IS NOT NULL AND o."locked_by" = :node AND :not_held

-- adbc, Postgres: count
SELECT (count(*))::int8 FROM "public"."outbox" o WHERE :condition

-- adbc, Postgres: pick
SELECT (o."sequence_id")::text FROM "public"."outbox" o WHERE :condition ORDER BY o."sequence_id" LIMIT $n

-- adbc, Postgres: delete
DELETE FROM "public"."outbox" WHERE "sequence_id" = ANY($ids)

-- adbc, Postgres: delete_dead_records
DELETE FROM "public"."outbox_dead_letters" WHERE id = ANY($ids)

-- adbc, Postgres: retry
UPDATE "public"."outbox" o SET "locked_by" = NULL, "lock_expiry" = NULL WHERE o."sequence_id" = :id AND o."locked_by" = $node AND :attempts >= 0 AND :error IS NOT NULL AND :delay >= 0

-- adbc, Postgres: dead_letter
UPDATE "public"."outbox" o SET "processed" = true, "locked_by" = NULL, "lock_expiry" = NULL WHERE o."sequence_id" = :id AND o."locked_by" = $node AND :attempts >= 0 AND :error IS NOT NULL

-- adbc, Postgres: columns_query
SELECT (column_name)::text, (data_type)::text FROM information_schema.columns WHERE table_schema = $1::text AND table_name = $2::text

-- adbc, Postgres: column_length_query
SELECT (character_maximum_length)::int8, (character_octet_length)::int8 FROM information_schema.columns WHERE table_schema = $3::text AND table_name = $4::text AND column_name = $5::text

-- adbc, Postgres: unique_column_query
SELECT count(*)::int8 FROM pg_index i JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0] WHERE i.indrelid = to_regclass($6::text) AND i.indisunique AND i.indnkeyatts = 1 AND i.indpred IS NULL AND a.attname = $7::text

-- adbc, Postgres: insert
INSERT INTO "public"."outbox" ("sequence_id", "channel") VALUES ($1, $2) RETURNING "sequence_id"

-- adbc, Postgres: not_in_ids
o."sequence_id" NOT IN (SELECT unnest($8::int8[]))

-- adbc, Postgres: not_in_texts
(o."channel")::text NOT IN (SELECT unnest($9::text[]))

-- adbc, MySql: table
`public`.`outbox`

-- adbc, MySql: dead_table
`public`.`outbox_dead_letters`

-- adbc, MySql: now
UTC_TIMESTAMP(6)

-- adbc, MySql: id_expr
(o.`sequence_id` + 0)

-- adbc, MySql: key_expr
CAST(o.`channel` AS CHAR)

-- adbc, MySql: select_list
(o.`sequence_id` + 0), NULL, CAST(o.`channel` AS CHAR), NULL, CAST(o.`name` AS CHAR), o.`data`, CAST(o.`headers` AS CHAR), CAST(o.`mutation_id` AS CHAR), CAST(CASE WHEN o.`rejected` THEN 1 ELSE 0 END AS SIGNED), NULL, NULL, NULL, NULL, NULL

-- adbc, MySql: pending
o.`processed` = false

-- adbc, MySql: dead
o.`processed` = true

-- adbc, MySql: delivered
(none)

-- adbc, MySql: claimable
o.`processed` = false AND (o.`lock_expiry` IS NULL OR o.`lock_expiry` < UTC_TIMESTAMP(6))

-- adbc, MySql: order_by
o.`sequence_id`

-- adbc, MySql: claim_set
`locked_by` = :node, `lock_expiry` = UTC_TIMESTAMP(6) + INTERVAL (:lease * 1000) MICROSECOND

-- adbc, MySql: fence
o.`locked_by` = :node

-- adbc, MySql: ack
DELETE FROM `public`.`outbox` WHERE `public`.`outbox`.`sequence_id` IN (1, 2) AND `public`.`outbox`.`locked_by` = :node ORDER BY `sequence_id` LIMIT 2

-- adbc, MySql: retry_set
`locked_by` = NULL, `lock_expiry` = NULL

-- adbc, MySql: dead_set
`processed` = true, `locked_by` = NULL, `lock_expiry` = NULL

-- adbc, MySql: release
UPDATE `public`.`outbox` o SET o.`locked_by` = NULL, o.`lock_expiry` = NULL WHERE o.`sequence_id` IN (1, 2) AND o.`locked_by` = :node

-- adbc, MySql: release unheld
UPDATE `public`.`outbox` o SET o.`locked_by` = NULL, o.`lock_expiry` = NULL WHERE o.`locked_by` IS NOT NULL AND o.`locked_by` = :node AND :not_held

-- adbc, MySql: extend
UPDATE `public`.`outbox` o SET o.`lock_expiry` = UTC_TIMESTAMP(6) + INTERVAL (:lease * 1000) MICROSECOND WHERE o.`sequence_id` IN (1, 2) AND o.`locked_by` = :node AND :lease >= 0

-- adbc, MySql: reap to pending
UPDATE `public`.`outbox` o SET o.`locked_by` = NULL, o.`lock_expiry` = NULL WHERE o.`locked_by` IS NOT NULL AND (:all OR o.`lock_expiry` < UTC_TIMESTAMP(6)) AND :max IS NOT NULL AND :lease >= 0

-- adbc, MySql: reap to dead
(none)

-- adbc, MySql: stats
SELECT CAST(coalesce(sum(CASE WHEN o.`processed` = false THEN 1 ELSE 0 END), 0) AS SIGNED), CAST(coalesce(sum(CASE WHEN 1 = 0 THEN 1 ELSE 0 END), 0) AS SIGNED), CAST(coalesce(sum(CASE WHEN o.`processed` = true THEN 1 ELSE 0 END), 0) AS SIGNED), NULL FROM `public`.`outbox` o WHERE (o.`processed` = false) OR (o.`processed` = true)

-- adbc, MySql: stats by destination
SELECT CAST(o.`channel` AS CHAR), CAST(coalesce(sum(CASE WHEN o.`processed` = false THEN 1 ELSE 0 END), 0) AS SIGNED), CAST(coalesce(sum(CASE WHEN 1 = 0 THEN 1 ELSE 0 END), 0) AS SIGNED), CAST(coalesce(sum(CASE WHEN o.`processed` = true THEN 1 ELSE 0 END), 0) AS SIGNED), NULL FROM `public`.`outbox` o WHERE (o.`processed` = false) OR (o.`processed` = true) GROUP BY CAST(o.`channel` AS CHAR) ORDER BY CAST(o.`channel` AS CHAR)

-- adbc, MySql: dead_list
SELECT CAST(o.`sequence_id` AS CHAR), NULL, CAST(o.`channel` AS CHAR), CAST(o.`name` AS CHAR), NULL, NULL, NULL FROM `public`.`outbox` o WHERE o.`processed` = true AND :filter ORDER BY o.`sequence_id` LIMIT :n

-- adbc, MySql: event
SELECT (o.`sequence_id` + 0), NULL, CAST(o.`channel` AS CHAR), NULL, CAST(o.`name` AS CHAR), o.`data`, CAST(o.`headers` AS CHAR), CAST(o.`mutation_id` AS CHAR), CAST(CASE WHEN o.`rejected` THEN 1 ELSE 0 END AS SIGNED), NULL, NULL, NULL, NULL, NULL, CAST((CASE WHEN o.`processed` = true THEN 2 WHEN 1 = 0 THEN 1 ELSE 0 END) AS SIGNED), NULL, NULL, NULL FROM `public`.`outbox` o WHERE :condition

-- adbc, MySql: dead_retry
UPDATE `public`.`outbox` o SET o.`processed` = false, o.`locked_by` = NULL, o.`lock_expiry` = NULL WHERE (o.`processed` = true) AND :condition

-- adbc, MySql: destination_text
CAST(o.`channel` AS CHAR)

-- adbc, MySql: delivered_time
(none)

-- adbc, MySql: dead_time
(none)

-- adbc, MySql: created_at
(none)

-- adbc, MySql: replay_set
`processed` = false

-- adbc, MySql: dead_table_ddl
(none)

-- adbc, MySql: ddl
DO $create_schema$ BEGIN IF to_regnamespace('"public"') IS NULL THEN CREATE SCHEMA "public"; END IF; END $create_schema$;
CREATE TABLE IF NOT EXISTS "public"."outbox" ( sequence_id serial PRIMARY KEY, mutation_id TEXT NOT NULL, channel TEXT NOT NULL, name TEXT NOT NULL, rejected boolean NOT NULL DEFAULT false, data JSONB, headers JSONB, locked_by TEXT, lock_expiry TIMESTAMP WITHOUT TIME ZONE, processed BOOLEAN NOT NULL DEFAULT false );
CREATE OR REPLACE FUNCTION "public"."outbox_notify"() RETURNS trigger AS $$ BEGIN PERFORM pg_notify('ably_adbc'::text, ''::text); RETURN NULL; EXCEPTION -- ensure this function can never throw an uncaught exception
 WHEN others THEN RAISE WARNING 'unexpected error in %s: %%', SQLERRM; RETURN NULL; END; $$ LANGUAGE plpgsql;
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_trigger WHERE tgname = 'outbox_trigger' AND tgrelid = '"public"."outbox"'::regclass) THEN
        CREATE TRIGGER "outbox_trigger" AFTER INSERT ON "public"."outbox" FOR EACH STATEMENT EXECUTE PROCEDURE "public"."outbox_notify"();
    END IF;
END
$$;


-- adbc, MySql: grants
GRANT SELECT, UPDATE, DELETE ON `public`.`outbox` TO 'relay'@'%';
-- Operators (`dead purge`, `prune`) also need DELETE on `public`.`outbox`.


-- adbc, MySql: claim_select
SELECT (o.`sequence_id` + 0), NULL, CAST(o.`channel` AS CHAR), NULL, CAST(o.`name` AS CHAR), o.`data`, CAST(o.`headers` AS CHAR), CAST(o.`mutation_id` AS CHAR), CAST(CASE WHEN o.`rejected` THEN 1 ELSE 0 END AS SIGNED), NULL, NULL, NULL, NULL, NULL FROM `public`.`outbox` o WHERE :condition ORDER BY o.`sequence_id` LIMIT :n

-- adbc, MySql: claim_select locking
SELECT (o.`sequence_id` + 0), NULL, CAST(o.`channel` AS CHAR), NULL, CAST(o.`name` AS CHAR), o.`data`, CAST(o.`headers` AS CHAR), CAST(o.`mutation_id` AS CHAR), CAST(CASE WHEN o.`rejected` THEN 1 ELSE 0 END AS SIGNED), NULL, NULL, NULL, NULL, NULL FROM `public`.`outbox` o WHERE :condition ORDER BY o.`sequence_id` LIMIT :n FOR UPDATE SKIP LOCKED

-- adbc, MySql: claim_and_mark
WITH l AS (SELECT o.`sequence_id` AS id FROM `public`.`outbox` o WHERE :condition
                         ORDER BY o.`sequence_id` LIMIT :n FOR UPDATE SKIP LOCKED),
                  u AS (SELECT x.id, x.k, row_number() OVER () AS n
                          FROM (SELECT o.`sequence_id` AS id, CAST(o.`channel` AS CHAR) AS k FROM `public`.`outbox` o WHERE :condition
                                 ORDER BY o.`sequence_id` LIMIT :n) x),
                  passed AS (SELECT k, min(n) AS n FROM u
                              WHERE NOT EXISTS (SELECT 1 FROM l WHERE l.id = u.id) GROUP BY k),
                  c AS (SELECT u.id, u.n FROM u JOIN l ON l.id = u.id
                          LEFT JOIN passed ON passed.k IS NOT DISTINCT FROM u.k
                         WHERE passed.n IS NULL OR u.n < passed.n)
             UPDATE `public`.`outbox` o SET `locked_by` = :node, `lock_expiry` = UTC_TIMESTAMP(6) + INTERVAL (:lease * 1000) MICROSECOND FROM c
              WHERE o.`sequence_id` = c.id AND :node IS NOT NULL AND :lease >= 0
             RETURNING (o.`sequence_id` + 0), NULL, CAST(o.`channel` AS CHAR), NULL, CAST(o.`name` AS CHAR), o.`data`, CAST(o.`headers` AS CHAR), CAST(o.`mutation_id` AS CHAR), CAST(CASE WHEN o.`rejected` THEN 1 ELSE 0 END AS SIGNED), NULL, NULL, NULL, NULL, NULL, c.n

-- adbc, MySql: claim_order_column
14

-- adbc, MySql: at_micros
FROM_UNIXTIME(:micros / 1000000)

-- adbc, MySql: destination_is
CAST(CAST(o.`channel` AS CHAR) AS BINARY) = CAST(:destination AS BINARY)

-- adbc, MySql: delivered_between
(none)

-- adbc, MySql: delivered_before
(none)

-- adbc, MySql: dead_before
(none)

-- adbc, MySql: release_unheld
UPDATE `public`.`outbox` o SET o.`locked_by` = NULL, o.`lock_expiry` = NULL WHERE o.`locked_by` IS NOT NULL AND o.`locked_by` = :node AND :not_held

-- adbc, MySql: count
SELECT CAST(count(*) AS SIGNED) FROM `public`.`outbox` o WHERE :condition

-- adbc, MySql: pick
SELECT CAST(o.`sequence_id` AS CHAR) FROM `public`.`outbox` o WHERE :condition ORDER BY o.`sequence_id` LIMIT :n

-- adbc, MySql: delete
DELETE FROM `public`.`outbox` WHERE `sequence_id` IN (1, 2)

-- adbc, MySql: delete_dead_records
DELETE FROM `public`.`outbox_dead_letters` WHERE id IN (1, 2)

-- adbc, MySql: retry
UPDATE `public`.`outbox` o SET o.`locked_by` = NULL, o.`lock_expiry` = NULL WHERE o.`sequence_id` = :id AND o.`locked_by` = :node AND :attempts >= 0 AND :error IS NOT NULL AND :delay >= 0

-- adbc, MySql: dead_letter
UPDATE `public`.`outbox` o SET o.`processed` = true, o.`locked_by` = NULL, o.`lock_expiry` = NULL WHERE o.`sequence_id` = :id AND o.`locked_by` = :node AND :attempts >= 0 AND :error IS NOT NULL

-- adbc, MySql: columns_query
SELECT CAST(column_name AS CHAR), CAST(data_type AS CHAR) FROM information_schema.columns WHERE table_schema = :p1 AND table_name = :p2

-- adbc, MySql: column_length_query
SELECT CAST(character_maximum_length AS SIGNED), CAST(character_octet_length AS SIGNED) FROM information_schema.columns WHERE table_schema = :p3 AND table_name = :p4 AND column_name = :p5

-- adbc, MySql: unique_column_query
SELECT CAST(COUNT(*) AS SIGNED) FROM (SELECT index_name FROM information_schema.statistics WHERE table_schema = :p6 AND table_name = :p7 AND non_unique = 0 GROUP BY index_name HAVING COUNT(*) = 1 AND MAX(column_name) = :p8 AND MAX(sub_part) IS NULL) u

-- adbc, MySql: insert
INSERT INTO `public`.`outbox` (`sequence_id`, `channel`) VALUES (?, ?)

-- adbc, MySql: not_in_ids
o.`sequence_id` NOT IN (1, 2)

-- adbc, MySql: not_in_texts
CAST(CAST(o.`channel` AS CHAR) AS BINARY) NOT IN (CAST(:p9 AS BINARY), CAST(:p10 AS BINARY))

-- open_outbox, Postgres: table
"public"."openoutbox_events"

-- open_outbox, Postgres: dead_table
"public"."openoutbox_events_dead_letters"

-- open_outbox, Postgres: now
now()

-- open_outbox, Postgres: id_expr
o."event_id"

-- open_outbox, Postgres: key_expr
coalesce((o."partition_key")::text, (o."event_type")::text)

-- open_outbox, Postgres: select_list
o."event_id", (o."event_id")::text, (o."event_type")::text, (o."partition_key")::text, (o."event_type")::text, o."payload", (o."headers")::text, NULL::text, NULL::int8, (o."attempts")::int8, CASE WHEN isfinite(o."created_at") THEN (extract(epoch from o."created_at") * 1000000)::int8 WHEN o."created_at" > 'epoch' THEN 9223372036854775807 ELSE -9223372036854775807 - 1 END, NULL::int8, NULL::text, NULL::text

-- open_outbox, Postgres: pending
o."status" IN ('PENDING', 'DELIVERING')

-- open_outbox, Postgres: dead
o."status" = 'DEAD'

-- open_outbox, Postgres: delivered
o."status" = 'DELIVERED'

-- open_outbox, Postgres: claimable
o."status" = 'PENDING' AND o."available_at" <= now()

-- open_outbox, Postgres: order_by
o."created_at", o."event_id"

-- open_outbox, Postgres: claim_set
"status" = 'DELIVERING', "locked_by" = $node, "locked_at" = now(), "updated_at" = now()

-- open_outbox, Postgres: fence
o."locked_by" = $node

-- open_outbox, Postgres: ack
UPDATE "public"."openoutbox_events" o SET "status" = 'DELIVERED', "delivered_at" = now(), "locked_by" = NULL, "locked_at" = NULL, "updated_at" = now() WHERE o."event_id" = ANY($ids) AND o."locked_by" = $node

-- open_outbox, Postgres: retry_set
"status" = 'PENDING', "locked_by" = NULL, "locked_at" = NULL, "attempts" = :attempts, "last_error" = :error, "available_at" = now() + :delay::int8 * interval '1 millisecond', "updated_at" = now()

-- open_outbox, Postgres: dead_set
"status" = 'DEAD', "attempts" = :attempts, "last_error" = :error, "locked_by" = NULL, "locked_at" = NULL, "updated_at" = now()

-- open_outbox, Postgres: release
UPDATE "public"."openoutbox_events" o SET "status" = 'PENDING', "locked_by" = NULL, "locked_at" = NULL, "updated_at" = now() WHERE o."event_id" = ANY($ids) AND o."locked_by" = $node

-- open_outbox, Postgres: release unheld
UPDATE "public"."openoutbox_events" o SET "status" = 'PENDING', "locked_by" = NULL, "locked_at" = NULL, "updated_at" = now() WHERE o."status" = 'DELIVERING' AND o."locked_by" = $node AND :not_held

-- open_outbox, Postgres: extend
UPDATE "public"."openoutbox_events" o SET "locked_at" = now() WHERE o."event_id" = ANY($ids) AND o."locked_by" = $node AND $lease >= 0

-- open_outbox, Postgres: reap to pending
UPDATE "public"."openoutbox_events" o SET "status" = 'PENDING', "locked_by" = NULL, "locked_at" = NULL, "attempts" = o."attempts" + 1, "last_error" = 'the relay holding this event stopped before settling it (lease expired); counted as an attempt', "updated_at" = now() WHERE o."status" = 'DELIVERING' AND (:all OR o."locked_at" < now() - $lease::int8 * interval '1 millisecond') AND o."attempts" + 1 < :max AND $lease >= 0

-- open_outbox, Postgres: reap to dead
UPDATE "public"."openoutbox_events" o SET "status" = 'DEAD', "locked_by" = NULL, "locked_at" = NULL, "attempts" = o."attempts" + 1, "last_error" = 'the relay holding this event stopped before settling it (lease expired); counted as an attempt', "updated_at" = now() WHERE o."status" = 'DELIVERING' AND (:all OR o."locked_at" < now() - $lease::int8 * interval '1 millisecond') AND o."attempts" + 1 >= :max AND $lease >= 0

-- open_outbox, Postgres: stats
SELECT (coalesce(sum(CASE WHEN o."status" IN ('PENDING', 'DELIVERING') THEN 1 ELSE 0 END), 0))::int8, (coalesce(sum(CASE WHEN (o."status" IN ('PENDING', 'DELIVERING')) AND o."attempts" > 0 THEN 1 ELSE 0 END), 0))::int8, (coalesce(sum(CASE WHEN o."status" = 'DEAD' THEN 1 ELSE 0 END), 0))::int8, (extract(epoch from now() - min(CASE WHEN o."status" IN ('PENDING', 'DELIVERING') AND isfinite(o."created_at") THEN CASE WHEN o."attempts" > 0 THEN o."created_at" WHEN o."available_at" IS NULL THEN o."created_at" WHEN o."available_at" <= now() THEN (CASE WHEN o."available_at" > o."created_at" THEN o."available_at" ELSE o."created_at" END) END END)) * 1000)::int8 FROM "public"."openoutbox_events" o WHERE (o."status" IN ('PENDING', 'DELIVERING')) OR (o."status" = 'DEAD')

-- open_outbox, Postgres: stats by destination
SELECT (o."event_type")::text, (coalesce(sum(CASE WHEN o."status" IN ('PENDING', 'DELIVERING') THEN 1 ELSE 0 END), 0))::int8, (coalesce(sum(CASE WHEN (o."status" IN ('PENDING', 'DELIVERING')) AND o."attempts" > 0 THEN 1 ELSE 0 END), 0))::int8, (coalesce(sum(CASE WHEN o."status" = 'DEAD' THEN 1 ELSE 0 END), 0))::int8, (extract(epoch from now() - min(CASE WHEN o."status" IN ('PENDING', 'DELIVERING') AND isfinite(o."created_at") THEN CASE WHEN o."attempts" > 0 THEN o."created_at" WHEN o."available_at" IS NULL THEN o."created_at" WHEN o."available_at" <= now() THEN (CASE WHEN o."available_at" > o."created_at" THEN o."available_at" ELSE o."created_at" END) END END)) * 1000)::int8 FROM "public"."openoutbox_events" o WHERE (o."status" IN ('PENDING', 'DELIVERING')) OR (o."status" = 'DEAD') GROUP BY (o."event_type")::text ORDER BY (o."event_type")::text

-- open_outbox, Postgres: dead_list
SELECT (o."event_id")::text, (o."event_id")::text, (o."event_type")::text, (o."event_type")::text, (o."attempts")::int8, (o."last_error")::text, CASE WHEN isfinite(o."updated_at") THEN (extract(epoch from o."updated_at") * 1000000)::int8 WHEN o."updated_at" > 'epoch' THEN 9223372036854775807 ELSE -9223372036854775807 - 1 END FROM "public"."openoutbox_events" o WHERE o."status" = 'DEAD' AND :filter ORDER BY o."created_at", o."event_id" LIMIT $n

-- open_outbox, Postgres: event
SELECT o."event_id", (o."event_id")::text, (o."event_type")::text, (o."partition_key")::text, (o."event_type")::text, o."payload", (o."headers")::text, NULL::text, NULL::int8, (o."attempts")::int8, CASE WHEN isfinite(o."created_at") THEN (extract(epoch from o."created_at") * 1000000)::int8 WHEN o."created_at" > 'epoch' THEN 9223372036854775807 ELSE -9223372036854775807 - 1 END, NULL::int8, NULL::text, NULL::text, ((CASE WHEN o."status" = 'DEAD' THEN 2 WHEN o."status" = 'DELIVERED' THEN 1 ELSE 0 END))::int8, (o."attempts")::int8, (o."last_error")::text, CASE WHEN isfinite(o."updated_at") THEN (extract(epoch from o."updated_at") * 1000000)::int8 WHEN o."updated_at" > 'epoch' THEN 9223372036854775807 ELSE -9223372036854775807 - 1 END FROM "public"."openoutbox_events" o WHERE :condition

-- open_outbox, Postgres: dead_retry
UPDATE "public"."openoutbox_events" o SET "status" = 'PENDING', "attempts" = 0, "last_error" = NULL, "available_at" = now(), "locked_by" = NULL, "locked_at" = NULL, "updated_at" = now() WHERE (o."status" = 'DEAD') AND :condition

-- open_outbox, Postgres: destination_text
(o."event_type")::text

-- open_outbox, Postgres: delivered_time
o."delivered_at"

-- open_outbox, Postgres: dead_time
o."updated_at"

-- open_outbox, Postgres: created_at
o."created_at"

-- open_outbox, Postgres: replay_set
"status" = 'PENDING', "delivered_at" = NULL, "attempts" = 0, "available_at" = now(), "updated_at" = now()

-- open_outbox, Postgres: dead_table_ddl
(none)

-- open_outbox, Postgres: ddl
DO $create_schema$ BEGIN IF to_regnamespace('"public"') IS NULL THEN CREATE SCHEMA "public"; END IF; END $create_schema$;
CREATE TABLE IF NOT EXISTS "public"."openoutbox_events" (
    event_id UUID PRIMARY KEY,
    event_type TEXT NOT NULL,
    partition_key TEXT,
    payload BYTEA NOT NULL,
    headers JSONB NOT NULL DEFAULT '{}',
    status TEXT NOT NULL DEFAULT 'PENDING',
    attempts INT NOT NULL DEFAULT 0,
    last_error TEXT,
    available_at TIMESTAMPTZ NOT NULL DEFAULT NOW(),
    locked_by TEXT,
    locked_at TIMESTAMPTZ,
    delivered_at TIMESTAMPTZ,
    created_at TIMESTAMPTZ NOT NULL DEFAULT NOW(),
    updated_at TIMESTAMPTZ NOT NULL DEFAULT NOW(),
    CONSTRAINT check_valid_status CHECK ( status IN ('PENDING', 'DELIVERING', 'DELIVERED', 'DEAD') ));
DO $relay$ BEGIN IF to_regclass('"public".idx_openoutbox_events_processing_queue') IS NULL THEN CREATE INDEX idx_openoutbox_events_processing_queue ON "public"."openoutbox_events" (available_at ASC, created_at ASC) WHERE status = 'PENDING'; END IF; END $relay$;
DO $relay$ BEGIN IF to_regclass('"public".idx_openoutbox_events_stuck_leases') IS NULL THEN CREATE INDEX idx_openoutbox_events_stuck_leases ON "public"."openoutbox_events" (locked_at ASC) WHERE status = 'DELIVERING'; END IF; END $relay$;
DO $relay$ BEGIN IF to_regclass('"public".idx_openoutbox_events_metrics_count') IS NULL THEN CREATE INDEX idx_openoutbox_events_metrics_count ON "public"."openoutbox_events" (status) INCLUDE (attempts) WHERE status = 'PENDING'; END IF; END $relay$;
DO $relay$ BEGIN IF to_regclass('"public".idx_openoutbox_events_metrics_lag') IS NULL THEN CREATE INDEX idx_openoutbox_events_metrics_lag ON "public"."openoutbox_events" (status, created_at ASC) WHERE status = 'PENDING'; END IF; END $relay$;
DO $relay$ BEGIN IF to_regclass('"public".idx_openoutbox_events_prune_delivered') IS NULL THEN CREATE INDEX idx_openoutbox_events_prune_delivered ON "public"."openoutbox_events" (delivered_at) WHERE status = 'DELIVERED'; END IF; END $relay$;
DO $relay$ BEGIN IF to_regclass('"public".idx_openoutbox_events_prune_dead') IS NULL THEN CREATE INDEX idx_openoutbox_events_prune_dead ON "public"."openoutbox_events" (updated_at) WHERE status = 'DEAD'; END IF; END $relay$;


-- open_outbox, Postgres: grants
GRANT SELECT, UPDATE ON "public"."openoutbox_events" TO "relay";
-- Operators (`dead purge`, `prune`) also need DELETE on "public"."openoutbox_events".


-- open_outbox, Postgres: claim_select
SELECT o."event_id", (o."event_id")::text, (o."event_type")::text, (o."partition_key")::text, (o."event_type")::text, o."payload", (o."headers")::text, NULL::text, NULL::int8, (o."attempts")::int8, CASE WHEN isfinite(o."created_at") THEN (extract(epoch from o."created_at") * 1000000)::int8 WHEN o."created_at" > 'epoch' THEN 9223372036854775807 ELSE -9223372036854775807 - 1 END, NULL::int8, NULL::text, NULL::text FROM "public"."openoutbox_events" o WHERE :condition ORDER BY o."created_at", o."event_id" LIMIT $n

-- open_outbox, Postgres: claim_select locking
SELECT o."event_id", (o."event_id")::text, (o."event_type")::text, (o."partition_key")::text, (o."event_type")::text, o."payload", (o."headers")::text, NULL::text, NULL::int8, (o."attempts")::int8, CASE WHEN isfinite(o."created_at") THEN (extract(epoch from o."created_at") * 1000000)::int8 WHEN o."created_at" > 'epoch' THEN 9223372036854775807 ELSE -9223372036854775807 - 1 END, NULL::int8, NULL::text, NULL::text FROM "public"."openoutbox_events" o WHERE :condition ORDER BY o."created_at", o."event_id" LIMIT $n FOR UPDATE SKIP LOCKED

-- open_outbox, Postgres: claim_and_mark
WITH l AS (SELECT o."event_id" AS id FROM "public"."openoutbox_events" o WHERE :condition
                         ORDER BY o."created_at", o."event_id" LIMIT $n FOR UPDATE SKIP LOCKED),
                  u AS (SELECT x.id, x.k, row_number() OVER () AS n
                          FROM (SELECT o."event_id" AS id, coalesce((o."partition_key")::text, (o."event_type")::text) AS k FROM "public"."openoutbox_events" o WHERE :condition
                                 ORDER BY o."created_at", o."event_id" LIMIT $n) x),
                  passed AS (SELECT k, min(n) AS n FROM u
                              WHERE NOT EXISTS (SELECT 1 FROM l WHERE l.id = u.id) GROUP BY k),
                  c AS (SELECT u.id, u.n FROM u JOIN l ON l.id = u.id
                          LEFT JOIN passed ON passed.k IS NOT DISTINCT FROM u.k
                         WHERE passed.n IS NULL OR u.n < passed.n)
             UPDATE "public"."openoutbox_events" o SET "status" = 'DELIVERING', "locked_by" = $node, "locked_at" = now(), "updated_at" = now() FROM c
              WHERE o."event_id" = c.id AND $node IS NOT NULL AND $lease >= 0
             RETURNING o."event_id", (o."event_id")::text, (o."event_type")::text, (o."partition_key")::text, (o."event_type")::text, o."payload", (o."headers")::text, NULL::text, NULL::int8, (o."attempts")::int8, CASE WHEN isfinite(o."created_at") THEN (extract(epoch from o."created_at") * 1000000)::int8 WHEN o."created_at" > 'epoch' THEN 9223372036854775807 ELSE -9223372036854775807 - 1 END, NULL::int8, NULL::text, NULL::text, c.n

-- open_outbox, Postgres: claim_order_column
14

-- open_outbox, Postgres: at_micros
to_timestamp(:micros::float8 / 1e6)

-- open_outbox, Postgres: destination_is
(o."event_type")::text = :destination

-- open_outbox, Postgres: delivered_between
(o."status" = 'DELIVERED') AND o."created_at" >= to_timestamp(:since::float8 / 1e6) AND o."created_at" < to_timestamp(:until::float8 / 1e6)

-- open_outbox, Postgres: delivered_before
(o."status" = 'DELIVERED') AND o."delivered_at" < to_timestamp(:before::float8 / 1e6)

-- open_outbox, Postgres: dead_before
(o."status" = 'DEAD') AND o."updated_at" < to_timestamp(:before::float8 / 1e6)

-- open_outbox, Postgres: release_unheld
UPDATE "public"."openoutbox_events" o SET "status" = 'PENDING', "locked_by" = NULL, "locked_at" = NULL, "updated_at" = now() WHERE o."status" = 'DELIVERING' AND o."locked_by" = :node AND :not_held

-- open_outbox, Postgres: count
SELECT (count(*))::int8 FROM "public"."openoutbox_events" o WHERE :condition

-- open_outbox, Postgres: pick
SELECT (o."event_id")::text FROM "public"."openoutbox_events" o WHERE :condition ORDER BY o."event_id" LIMIT $n

-- open_outbox, Postgres: delete
DELETE FROM "public"."openoutbox_events" WHERE "event_id" = ANY($ids)

-- open_outbox, Postgres: delete_dead_records
DELETE FROM "public"."openoutbox_events_dead_letters" WHERE id = ANY($ids)

-- open_outbox, Postgres: retry
UPDATE "public"."openoutbox_events" o SET "status" = 'PENDING', "locked_by" = NULL, "locked_at" = NULL, "attempts" = :attempts, "last_error" = :error, "available_at" = now() + :delay::int8 * interval '1 millisecond', "updated_at" = now() WHERE o."event_id" = :id AND o."locked_by" = $node AND :attempts >= 0 AND :error IS NOT NULL AND :delay >= 0

-- open_outbox, Postgres: dead_letter
UPDATE "public"."openoutbox_events" o SET "status" = 'DEAD', "attempts" = :attempts, "last_error" = :error, "locked_by" = NULL, "locked_at" = NULL, "updated_at" = now() WHERE o."event_id" = :id AND o."locked_by" = $node AND :attempts >= 0 AND :error IS NOT NULL

-- open_outbox, Postgres: columns_query
SELECT (column_name)::text, (data_type)::text FROM information_schema.columns WHERE table_schema = $1::text AND table_name = $2::text

-- open_outbox, Postgres: column_length_query
SELECT (character_maximum_length)::int8, (character_octet_length)::int8 FROM information_schema.columns WHERE table_schema = $3::text AND table_name = $4::text AND column_name = $5::text

-- open_outbox, Postgres: unique_column_query
SELECT count(*)::int8 FROM pg_index i JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0] WHERE i.indrelid = to_regclass($6::text) AND i.indisunique AND i.indnkeyatts = 1 AND i.indpred IS NULL AND a.attname = $7::text

-- open_outbox, Postgres: insert
INSERT INTO "public"."openoutbox_events" ("event_id", "event_type") VALUES ($1, $2) RETURNING "event_id"

-- open_outbox, Postgres: not_in_ids
o."event_id" NOT IN (SELECT unnest($8::uuid[]))

-- open_outbox, Postgres: not_in_texts
coalesce((o."partition_key")::text, (o."event_type")::text) NOT IN (SELECT unnest($9::text[]))

-- open_outbox, MySql: table
`public`.`openoutbox_events`

-- open_outbox, MySql: dead_table
`public`.`openoutbox_events_dead_letters`

-- open_outbox, MySql: now
UTC_TIMESTAMP(6)

-- open_outbox, MySql: id_expr
o.`event_id`

-- open_outbox, MySql: key_expr
coalesce(CAST(o.`partition_key` AS CHAR), CAST(o.`event_type` AS CHAR))

-- open_outbox, MySql: select_list
o.`event_id`, CAST(o.`event_id` AS CHAR), CAST(o.`event_type` AS CHAR), CAST(o.`partition_key` AS CHAR), CAST(o.`event_type` AS CHAR), o.`payload`, CAST(o.`headers` AS CHAR), NULL, NULL, CAST(o.`attempts` AS SIGNED), TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', o.`created_at`), NULL, NULL, NULL

-- open_outbox, MySql: pending
o.`status` IN ('PENDING', 'DELIVERING')

-- open_outbox, MySql: dead
o.`status` = 'DEAD'

-- open_outbox, MySql: delivered
o.`status` = 'DELIVERED'

-- open_outbox, MySql: claimable
o.`status` = 'PENDING' AND o.`available_at` <= UTC_TIMESTAMP(6)

-- open_outbox, MySql: order_by
o.`created_at`, o.`event_id`

-- open_outbox, MySql: claim_set
`status` = 'DELIVERING', `locked_by` = :node, `locked_at` = UTC_TIMESTAMP(6), `updated_at` = UTC_TIMESTAMP(6)

-- open_outbox, MySql: fence
o.`locked_by` = :node

-- open_outbox, MySql: ack
UPDATE `public`.`openoutbox_events` o SET o.`status` = 'DELIVERED', o.`delivered_at` = UTC_TIMESTAMP(6), o.`locked_by` = NULL, o.`locked_at` = NULL, o.`updated_at` = UTC_TIMESTAMP(6) WHERE o.`event_id` IN (1, 2) AND o.`locked_by` = :node ORDER BY `event_id` LIMIT 2

-- open_outbox, MySql: retry_set
`status` = 'PENDING', `locked_by` = NULL, `locked_at` = NULL, `attempts` = :attempts, `last_error` = :error, `available_at` = UTC_TIMESTAMP(6) + INTERVAL (:delay * 1000) MICROSECOND, `updated_at` = UTC_TIMESTAMP(6)

-- open_outbox, MySql: dead_set
`status` = 'DEAD', `attempts` = :attempts, `last_error` = :error, `locked_by` = NULL, `locked_at` = NULL, `updated_at` = UTC_TIMESTAMP(6)

-- open_outbox, MySql: release
UPDATE `public`.`openoutbox_events` o SET o.`status` = 'PENDING', o.`locked_by` = NULL, o.`locked_at` = NULL, o.`updated_at` = UTC_TIMESTAMP(6) WHERE o.`event_id` IN (1, 2) AND o.`locked_by` = :node

-- open_outbox, MySql: release unheld
UPDATE `public`.`openoutbox_events` o SET o.`status` = 'PENDING', o.`locked_by` = NULL, o.`locked_at` = NULL, o.`updated_at` = UTC_TIMESTAMP(6) WHERE o.`status` = 'DELIVERING' AND o.`locked_by` = :node AND :not_held

-- open_outbox, MySql: extend
UPDATE `public`.`openoutbox_events` o SET o.`locked_at` = UTC_TIMESTAMP(6) WHERE o.`event_id` IN (1, 2) AND o.`locked_by` = :node AND :lease >= 0

-- open_outbox, MySql: reap to pending
UPDATE `public`.`openoutbox_events` o SET o.`status` = 'PENDING', o.`locked_by` = NULL, o.`locked_at` = NULL, o.`attempts` = o.`attempts` + 1, o.`last_error` = 'the relay holding this event stopped before settling it (lease expired); counted as an attempt', o.`updated_at` = UTC_TIMESTAMP(6) WHERE o.`status` = 'DELIVERING' AND (:all OR o.`locked_at` < UTC_TIMESTAMP(6) - INTERVAL (:lease * 1000) MICROSECOND) AND o.`attempts` + 1 < :max AND :lease >= 0

-- open_outbox, MySql: reap to dead
UPDATE `public`.`openoutbox_events` o SET o.`status` = 'DEAD', o.`locked_by` = NULL, o.`locked_at` = NULL, o.`attempts` = o.`attempts` + 1, o.`last_error` = 'the relay holding this event stopped before settling it (lease expired); counted as an attempt', o.`updated_at` = UTC_TIMESTAMP(6) WHERE o.`status` = 'DELIVERING' AND (:all OR o.`locked_at` < UTC_TIMESTAMP(6) - INTERVAL (:lease * 1000) MICROSECOND) AND o.`attempts` + 1 >= :max AND :lease >= 0

-- open_outbox, MySql: stats
SELECT CAST(coalesce(sum(CASE WHEN o.`status` IN ('PENDING', 'DELIVERING') THEN 1 ELSE 0 END), 0) AS SIGNED), CAST(coalesce(sum(CASE WHEN (o.`status` IN ('PENDING', 'DELIVERING')) AND o.`attempts` > 0 THEN 1 ELSE 0 END), 0) AS SIGNED), CAST(coalesce(sum(CASE WHEN o.`status` = 'DEAD' THEN 1 ELSE 0 END), 0) AS SIGNED), CAST(TIMESTAMPDIFF(MICROSECOND, min(CASE WHEN o.`status` IN ('PENDING', 'DELIVERING') THEN CASE WHEN o.`attempts` > 0 THEN o.`created_at` WHEN o.`available_at` IS NULL THEN o.`created_at` WHEN o.`available_at` <= UTC_TIMESTAMP(6) THEN (CASE WHEN o.`available_at` > o.`created_at` THEN o.`available_at` ELSE o.`created_at` END) END END), UTC_TIMESTAMP(6)) / 1000 AS SIGNED) FROM `public`.`openoutbox_events` o WHERE (o.`status` IN ('PENDING', 'DELIVERING')) OR (o.`status` = 'DEAD')

-- open_outbox, MySql: stats by destination
SELECT CAST(o.`event_type` AS CHAR), CAST(coalesce(sum(CASE WHEN o.`status` IN ('PENDING', 'DELIVERING') THEN 1 ELSE 0 END), 0) AS SIGNED), CAST(coalesce(sum(CASE WHEN (o.`status` IN ('PENDING', 'DELIVERING')) AND o.`attempts` > 0 THEN 1 ELSE 0 END), 0) AS SIGNED), CAST(coalesce(sum(CASE WHEN o.`status` = 'DEAD' THEN 1 ELSE 0 END), 0) AS SIGNED), CAST(TIMESTAMPDIFF(MICROSECOND, min(CASE WHEN o.`status` IN ('PENDING', 'DELIVERING') THEN CASE WHEN o.`attempts` > 0 THEN o.`created_at` WHEN o.`available_at` IS NULL THEN o.`created_at` WHEN o.`available_at` <= UTC_TIMESTAMP(6) THEN (CASE WHEN o.`available_at` > o.`created_at` THEN o.`available_at` ELSE o.`created_at` END) END END), UTC_TIMESTAMP(6)) / 1000 AS SIGNED) FROM `public`.`openoutbox_events` o WHERE (o.`status` IN ('PENDING', 'DELIVERING')) OR (o.`status` = 'DEAD') GROUP BY CAST(o.`event_type` AS CHAR) ORDER BY CAST(o.`event_type` AS CHAR)

-- open_outbox, MySql: dead_list
SELECT CAST(o.`event_id` AS CHAR), CAST(o.`event_id` AS CHAR), CAST(o.`event_type` AS CHAR), CAST(o.`event_type` AS CHAR), CAST(o.`attempts` AS SIGNED), CAST(o.`last_error` AS CHAR), TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', o.`updated_at`) FROM `public`.`openoutbox_events` o WHERE o.`status` = 'DEAD' AND :filter ORDER BY o.`created_at`, o.`event_id` LIMIT :n

-- open_outbox, MySql: event
SELECT o.`event_id`, CAST(o.`event_id` AS CHAR), CAST(o.`event_type` AS CHAR), CAST(o.`partition_key` AS CHAR), CAST(o.`event_type` AS CHAR), o.`payload`, CAST(o.`headers` AS CHAR), NULL, NULL, CAST(o.`attempts` AS SIGNED), TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', o.`created_at`), NULL, NULL, NULL, CAST((CASE WHEN o.`status` = 'DEAD' THEN 2 WHEN o.`status` = 'DELIVERED' THEN 1 ELSE 0 END) AS SIGNED), CAST(o.`attempts` AS SIGNED), CAST(o.`last_error` AS CHAR), TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', o.`updated_at`) FROM `public`.`openoutbox_events` o WHERE :condition

-- open_outbox, MySql: dead_retry
UPDATE `public`.`openoutbox_events` o SET o.`status` = 'PENDING', o.`attempts` = 0, o.`last_error` = NULL, o.`available_at` = UTC_TIMESTAMP(6), o.`locked_by` = NULL, o.`locked_at` = NULL, o.`updated_at` = UTC_TIMESTAMP(6) WHERE (o.`status` = 'DEAD') AND :condition

-- open_outbox, MySql: destination_text
CAST(o.`event_type` AS CHAR)

-- open_outbox, MySql: delivered_time
o.`delivered_at`

-- open_outbox, MySql: dead_time
o.`updated_at`

-- open_outbox, MySql: created_at
o.`created_at`

-- open_outbox, MySql: replay_set
`status` = 'PENDING', `delivered_at` = NULL, `attempts` = 0, `available_at` = UTC_TIMESTAMP(6), `updated_at` = UTC_TIMESTAMP(6)

-- open_outbox, MySql: dead_table_ddl
(none)

-- open_outbox, MySql: ddl
DO $create_schema$ BEGIN IF to_regnamespace('"public"') IS NULL THEN CREATE SCHEMA "public"; END IF; END $create_schema$;
CREATE TABLE IF NOT EXISTS "public"."openoutbox_events" (
    event_id UUID PRIMARY KEY,
    event_type TEXT NOT NULL,
    partition_key TEXT,
    payload BYTEA NOT NULL,
    headers JSONB NOT NULL DEFAULT '{}',
    status TEXT NOT NULL DEFAULT 'PENDING',
    attempts INT NOT NULL DEFAULT 0,
    last_error TEXT,
    available_at TIMESTAMPTZ NOT NULL DEFAULT NOW(),
    locked_by TEXT,
    locked_at TIMESTAMPTZ,
    delivered_at TIMESTAMPTZ,
    created_at TIMESTAMPTZ NOT NULL DEFAULT NOW(),
    updated_at TIMESTAMPTZ NOT NULL DEFAULT NOW(),
    CONSTRAINT check_valid_status CHECK ( status IN ('PENDING', 'DELIVERING', 'DELIVERED', 'DEAD') ));
DO $relay$ BEGIN IF to_regclass('"public".idx_openoutbox_events_processing_queue') IS NULL THEN CREATE INDEX idx_openoutbox_events_processing_queue ON "public"."openoutbox_events" (available_at ASC, created_at ASC) WHERE status = 'PENDING'; END IF; END $relay$;
DO $relay$ BEGIN IF to_regclass('"public".idx_openoutbox_events_stuck_leases') IS NULL THEN CREATE INDEX idx_openoutbox_events_stuck_leases ON "public"."openoutbox_events" (locked_at ASC) WHERE status = 'DELIVERING'; END IF; END $relay$;
DO $relay$ BEGIN IF to_regclass('"public".idx_openoutbox_events_metrics_count') IS NULL THEN CREATE INDEX idx_openoutbox_events_metrics_count ON "public"."openoutbox_events" (status) INCLUDE (attempts) WHERE status = 'PENDING'; END IF; END $relay$;
DO $relay$ BEGIN IF to_regclass('"public".idx_openoutbox_events_metrics_lag') IS NULL THEN CREATE INDEX idx_openoutbox_events_metrics_lag ON "public"."openoutbox_events" (status, created_at ASC) WHERE status = 'PENDING'; END IF; END $relay$;
DO $relay$ BEGIN IF to_regclass('"public".idx_openoutbox_events_prune_delivered') IS NULL THEN CREATE INDEX idx_openoutbox_events_prune_delivered ON "public"."openoutbox_events" (delivered_at) WHERE status = 'DELIVERED'; END IF; END $relay$;
DO $relay$ BEGIN IF to_regclass('"public".idx_openoutbox_events_prune_dead') IS NULL THEN CREATE INDEX idx_openoutbox_events_prune_dead ON "public"."openoutbox_events" (updated_at) WHERE status = 'DEAD'; END IF; END $relay$;


-- open_outbox, MySql: grants
GRANT SELECT, UPDATE ON `public`.`openoutbox_events` TO 'relay'@'%';
-- Operators (`dead purge`, `prune`) also need DELETE on `public`.`openoutbox_events`.


-- open_outbox, MySql: claim_select
SELECT o.`event_id`, CAST(o.`event_id` AS CHAR), CAST(o.`event_type` AS CHAR), CAST(o.`partition_key` AS CHAR), CAST(o.`event_type` AS CHAR), o.`payload`, CAST(o.`headers` AS CHAR), NULL, NULL, CAST(o.`attempts` AS SIGNED), TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', o.`created_at`), NULL, NULL, NULL FROM `public`.`openoutbox_events` o WHERE :condition ORDER BY o.`created_at`, o.`event_id` LIMIT :n

-- open_outbox, MySql: claim_select locking
SELECT o.`event_id`, CAST(o.`event_id` AS CHAR), CAST(o.`event_type` AS CHAR), CAST(o.`partition_key` AS CHAR), CAST(o.`event_type` AS CHAR), o.`payload`, CAST(o.`headers` AS CHAR), NULL, NULL, CAST(o.`attempts` AS SIGNED), TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', o.`created_at`), NULL, NULL, NULL FROM `public`.`openoutbox_events` o WHERE :condition ORDER BY o.`created_at`, o.`event_id` LIMIT :n FOR UPDATE SKIP LOCKED

-- open_outbox, MySql: claim_and_mark
WITH l AS (SELECT o.`event_id` AS id FROM `public`.`openoutbox_events` o WHERE :condition
                         ORDER BY o.`created_at`, o.`event_id` LIMIT :n FOR UPDATE SKIP LOCKED),
                  u AS (SELECT x.id, x.k, row_number() OVER () AS n
                          FROM (SELECT o.`event_id` AS id, coalesce(CAST(o.`partition_key` AS CHAR), CAST(o.`event_type` AS CHAR)) AS k FROM `public`.`openoutbox_events` o WHERE :condition
                                 ORDER BY o.`created_at`, o.`event_id` LIMIT :n) x),
                  passed AS (SELECT k, min(n) AS n FROM u
                              WHERE NOT EXISTS (SELECT 1 FROM l WHERE l.id = u.id) GROUP BY k),
                  c AS (SELECT u.id, u.n FROM u JOIN l ON l.id = u.id
                          LEFT JOIN passed ON passed.k IS NOT DISTINCT FROM u.k
                         WHERE passed.n IS NULL OR u.n < passed.n)
             UPDATE `public`.`openoutbox_events` o SET `status` = 'DELIVERING', `locked_by` = :node, `locked_at` = UTC_TIMESTAMP(6), `updated_at` = UTC_TIMESTAMP(6) FROM c
              WHERE o.`event_id` = c.id AND :node IS NOT NULL AND :lease >= 0
             RETURNING o.`event_id`, CAST(o.`event_id` AS CHAR), CAST(o.`event_type` AS CHAR), CAST(o.`partition_key` AS CHAR), CAST(o.`event_type` AS CHAR), o.`payload`, CAST(o.`headers` AS CHAR), NULL, NULL, CAST(o.`attempts` AS SIGNED), TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', o.`created_at`), NULL, NULL, NULL, c.n

-- open_outbox, MySql: claim_order_column
14

-- open_outbox, MySql: at_micros
FROM_UNIXTIME(:micros / 1000000)

-- open_outbox, MySql: destination_is
CAST(CAST(o.`event_type` AS CHAR) AS BINARY) = CAST(:destination AS BINARY)

-- open_outbox, MySql: delivered_between
(o.`status` = 'DELIVERED') AND o.`created_at` >= FROM_UNIXTIME(:since / 1000000) AND o.`created_at` < FROM_UNIXTIME(:until / 1000000)

-- open_outbox, MySql: delivered_before
(o.`status` = 'DELIVERED') AND o.`delivered_at` < FROM_UNIXTIME(:before / 1000000)

-- open_outbox, MySql: dead_before
(o.`status` = 'DEAD') AND o.`updated_at` < FROM_UNIXTIME(:before / 1000000)

-- open_outbox, MySql: release_unheld
UPDATE `public`.`openoutbox_events` o SET o.`status` = 'PENDING', o.`locked_by` = NULL, o.`locked_at` = NULL, o.`updated_at` = UTC_TIMESTAMP(6) WHERE o.`status` = 'DELIVERING' AND o.`locked_by` = :node AND :not_held

-- open_outbox, MySql: count
SELECT CAST(count(*) AS SIGNED) FROM `public`.`openoutbox_events` o WHERE :condition

-- open_outbox, MySql: pick
SELECT CAST(o.`event_id` AS CHAR) FROM `public`.`openoutbox_events` o WHERE :condition ORDER BY o.`event_id` LIMIT :n

-- open_outbox, MySql: delete
DELETE FROM `public`.`openoutbox_events` WHERE `event_id` IN (1, 2)

-- open_outbox, MySql: delete_dead_records
DELETE FROM `public`.`openoutbox_events_dead_letters` WHERE id IN (1, 2)

-- open_outbox, MySql: retry
UPDATE `public`.`openoutbox_events` o SET o.`status` = 'PENDING', o.`locked_by` = NULL, o.`locked_at` = NULL, o.`attempts` = :attempts, o.`last_error` = :error, o.`available_at` = UTC_TIMESTAMP(6) + INTERVAL (:delay * 1000) MICROSECOND, o.`updated_at` = UTC_TIMESTAMP(6) WHERE o.`event_id` = :id AND o.`locked_by` = :node AND :attempts >= 0 AND :error IS NOT NULL AND :delay >= 0

-- open_outbox, MySql: dead_letter
UPDATE `public`.`openoutbox_events` o SET o.`status` = 'DEAD', o.`attempts` = :attempts, o.`last_error` = :error, o.`locked_by` = NULL, o.`locked_at` = NULL, o.`updated_at` = UTC_TIMESTAMP(6) WHERE o.`event_id` = :id AND o.`locked_by` = :node AND :attempts >= 0 AND :error IS NOT NULL

-- open_outbox, MySql: columns_query
SELECT CAST(column_name AS CHAR), CAST(data_type AS CHAR) FROM information_schema.columns WHERE table_schema = :p1 AND table_name = :p2

-- open_outbox, MySql: column_length_query
SELECT CAST(character_maximum_length AS SIGNED), CAST(character_octet_length AS SIGNED) FROM information_schema.columns WHERE table_schema = :p3 AND table_name = :p4 AND column_name = :p5

-- open_outbox, MySql: unique_column_query
SELECT CAST(COUNT(*) AS SIGNED) FROM (SELECT index_name FROM information_schema.statistics WHERE table_schema = :p6 AND table_name = :p7 AND non_unique = 0 GROUP BY index_name HAVING COUNT(*) = 1 AND MAX(column_name) = :p8 AND MAX(sub_part) IS NULL) u

-- open_outbox, MySql: insert
INSERT INTO `public`.`openoutbox_events` (`event_id`, `event_type`) VALUES (?, ?)

-- open_outbox, MySql: not_in_ids
o.`event_id` NOT IN (1, 2)

-- open_outbox, MySql: not_in_texts
CAST(coalesce(CAST(o.`partition_key` AS CHAR), CAST(o.`event_type` AS CHAR)) AS BINARY) NOT IN (CAST(:p9 AS BINARY), CAST(:p10 AS BINARY))

-- export, Postgres: table
"public"."event"

-- export, Postgres: dead_table
"public"."event_dead_letters"

-- export, Postgres: now
now()

-- export, Postgres: id_expr
(o."id")::int8

-- export, Postgres: key_expr
'row:' || (o."id")::text

-- export, Postgres: select_list
(o."id")::int8, NULL::text, (o."type_code")::text, NULL::text, (o."type_code")::text, (o."payload")::text, NULL::text, NULL::text, NULL::int8, (o."processing_retries_count")::int8, CASE WHEN isfinite(o."created_at") THEN (extract(epoch from o."created_at") * 1000000)::int8 WHEN o."created_at" > 'epoch' THEN 9223372036854775807 ELSE -9223372036854775807 - 1 END, ((SELECT mx."max_retry_count" + 1 FROM "public"."event_type" mx WHERE mx."code" = o."type_code"))::int8, NULL::text, NULL::text

-- export, Postgres: pending
o."status" IN ('NEW', 'PROCESSING')

-- export, Postgres: dead
o."status" = 'ERROR'

-- export, Postgres: delivered
o."status" = 'DONE'

-- export, Postgres: claimable
o."status" = 'NEW'

-- export, Postgres: order_by
o."id"

-- export, Postgres: claim_set
"status" = 'PROCESSING', "updated_at" = now()

-- export, Postgres: fence
o."status" = 'PROCESSING' AND $node IS NOT NULL

-- export, Postgres: ack
UPDATE "public"."event" o SET "status" = 'DONE', "updated_at" = now() WHERE o."id" = ANY($ids) AND o."status" = 'PROCESSING' AND $node IS NOT NULL

-- export, Postgres: retry_set
"status" = 'NEW', "processing_retries_count" = :attempts, "updated_at" = now()

-- export, Postgres: dead_set
"status" = 'ERROR', "processing_retries_count" = :attempts, "updated_at" = now()

-- export, Postgres: release
UPDATE "public"."event" o SET "status" = 'NEW', "updated_at" = now() WHERE o."id" = ANY($ids) AND o."status" = 'PROCESSING' AND $node IS NOT NULL

-- export, Postgres: release unheld
UPDATE "public"."event" o SET "status" = 'NEW', "updated_at" = now() WHERE o."status" = 'PROCESSING' AND $node IS NOT NULL AND :not_held

-- export, Postgres: extend
UPDATE "public"."event" o SET "updated_at" = now() WHERE o."id" = ANY($ids) AND o."status" = 'PROCESSING' AND $node IS NOT NULL AND $lease >= 0

-- export, Postgres: reap to pending
UPDATE "public"."event" o SET "status" = 'NEW', "processing_retries_count" = o."processing_retries_count" + 1, "updated_at" = now() WHERE o."status" = 'PROCESSING' AND (:all OR o."updated_at" < now() - $lease::int8 * interval '1 millisecond') AND o."processing_retries_count" + 1 < coalesce((SELECT mx."max_retry_count" + 1 FROM "public"."event_type" mx WHERE mx."code" = o."type_code"), :max) AND $lease >= 0

-- export, Postgres: reap to dead
UPDATE "public"."event" o SET "status" = 'ERROR', "processing_retries_count" = o."processing_retries_count" + 1, "updated_at" = now() WHERE o."status" = 'PROCESSING' AND (:all OR o."updated_at" < now() - $lease::int8 * interval '1 millisecond') AND o."processing_retries_count" + 1 >= coalesce((SELECT mx."max_retry_count" + 1 FROM "public"."event_type" mx WHERE mx."code" = o."type_code"), :max) AND $lease >= 0

-- export, Postgres: stats
SELECT (coalesce(sum(CASE WHEN o."status" IN ('NEW', 'PROCESSING') THEN 1 ELSE 0 END), 0))::int8, (coalesce(sum(CASE WHEN (o."status" IN ('NEW', 'PROCESSING')) AND o."processing_retries_count" > 0 THEN 1 ELSE 0 END), 0))::int8, (coalesce(sum(CASE WHEN o."status" = 'ERROR' THEN 1 ELSE 0 END), 0))::int8, (extract(epoch from now() - min(CASE WHEN o."status" IN ('NEW', 'PROCESSING') AND isfinite(o."created_at") THEN o."created_at" END)) * 1000)::int8 FROM "public"."event" o WHERE (o."status" IN ('NEW', 'PROCESSING')) OR (o."status" = 'ERROR')

-- export, Postgres: stats by destination
SELECT (o."type_code")::text, (coalesce(sum(CASE WHEN o."status" IN ('NEW', 'PROCESSING') THEN 1 ELSE 0 END), 0))::int8, (coalesce(sum(CASE WHEN (o."status" IN ('NEW', 'PROCESSING')) AND o."processing_retries_count" > 0 THEN 1 ELSE 0 END), 0))::int8, (coalesce(sum(CASE WHEN o."status" = 'ERROR' THEN 1 ELSE 0 END), 0))::int8, (extract(epoch from now() - min(CASE WHEN o."status" IN ('NEW', 'PROCESSING') AND isfinite(o."created_at") THEN o."created_at" END)) * 1000)::int8 FROM "public"."event" o WHERE (o."status" IN ('NEW', 'PROCESSING')) OR (o."status" = 'ERROR') GROUP BY (o."type_code")::text ORDER BY (o."type_code")::text

-- export, Postgres: dead_list
SELECT (o."id")::text, NULL::text, (o."type_code")::text, (o."type_code")::text, (o."processing_retries_count")::int8, NULL::text, CASE WHEN isfinite(o."updated_at") THEN (extract(epoch from o."updated_at") * 1000000)::int8 WHEN o."updated_at" > 'epoch' THEN 9223372036854775807 ELSE -9223372036854775807 - 1 END FROM "public"."event" o WHERE o."status" = 'ERROR' AND :filter ORDER BY o."id" LIMIT $n

-- export, Postgres: event
SELECT (o."id")::int8, NULL::text, (o."type_code")::text, NULL::text, (o."type_code")::text, (o."payload")::text, NULL::text, NULL::text, NULL::int8, (o."processing_retries_count")::int8, CASE WHEN isfinite(o."created_at") THEN (extract(epoch from o."created_at") * 1000000)::int8 WHEN o."created_at" > 'epoch' THEN 9223372036854775807 ELSE -9223372036854775807 - 1 END, ((SELECT mx."max_retry_count" + 1 FROM "public"."event_type" mx WHERE mx."code" = o."type_code"))::int8, NULL::text, NULL::text, ((CASE WHEN o."status" = 'ERROR' THEN 2 WHEN o."status" = 'DONE' THEN 1 ELSE 0 END))::int8, (o."processing_retries_count")::int8, NULL::text, CASE WHEN isfinite(o."updated_at") THEN (extract(epoch from o."updated_at") * 1000000)::int8 WHEN o."updated_at" > 'epoch' THEN 9223372036854775807 ELSE -9223372036854775807 - 1 END FROM "public"."event" o WHERE :condition

-- export, Postgres: dead_retry
UPDATE "public"."event" o SET "status" = 'NEW', "processing_retries_count" = 0, "updated_at" = now() WHERE (o."status" = 'ERROR') AND :condition

-- export, Postgres: destination_text
(o."type_code")::text

-- export, Postgres: delivered_time
o."updated_at"

-- export, Postgres: dead_time
o."updated_at"

-- export, Postgres: created_at
o."created_at"

-- export, Postgres: replay_set
"status" = 'NEW', "processing_retries_count" = 0, "updated_at" = now()

-- export, Postgres: dead_table_ddl
(none)

-- export, Postgres: ddl
DO $create_schema$ BEGIN IF to_regnamespace('"public"') IS NULL THEN CREATE SCHEMA "public"; END IF; END $create_schema$;
CREATE TABLE IF NOT EXISTS "public"."event_type" (
    code text PRIMARY KEY,
    max_retry_count integer NOT NULL
);
CREATE TABLE IF NOT EXISTS "public"."event" (
    id bigserial PRIMARY KEY,
    type_code text NOT NULL REFERENCES "public"."event_type" (code),
    payload jsonb NOT NULL,
    status text NOT NULL DEFAULT 'NEW',
    processing_retries_count integer NOT NULL DEFAULT 0,
    created_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    updated_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
DO $relay$ BEGIN IF to_regclass('"public"."event_new_idx"') IS NULL THEN CREATE INDEX "event_new_idx" ON "public"."event" (id) WHERE status = 'NEW'; END IF; END $relay$;
DO $relay$ BEGIN IF to_regclass('"public"."event_processing_idx"') IS NULL THEN CREATE INDEX "event_processing_idx" ON "public"."event" (updated_at) WHERE status = 'PROCESSING'; END IF; END $relay$;


-- export, Postgres: grants
GRANT SELECT, UPDATE ON "public"."event" TO "relay";
GRANT SELECT ON "public"."event_type" TO "relay";
-- Operators (`dead purge`, `prune`) also need DELETE on "public"."event".


-- export, Postgres: claim_select
SELECT (o."id")::int8, NULL::text, (o."type_code")::text, NULL::text, (o."type_code")::text, (o."payload")::text, NULL::text, NULL::text, NULL::int8, (o."processing_retries_count")::int8, CASE WHEN isfinite(o."created_at") THEN (extract(epoch from o."created_at") * 1000000)::int8 WHEN o."created_at" > 'epoch' THEN 9223372036854775807 ELSE -9223372036854775807 - 1 END, ((SELECT mx."max_retry_count" + 1 FROM "public"."event_type" mx WHERE mx."code" = o."type_code"))::int8, NULL::text, NULL::text FROM "public"."event" o WHERE :condition ORDER BY o."id" LIMIT $n

-- export, Postgres: claim_select locking
SELECT (o."id")::int8, NULL::text, (o."type_code")::text, NULL::text, (o."type_code")::text, (o."payload")::text, NULL::text, NULL::text, NULL::int8, (o."processing_retries_count")::int8, CASE WHEN isfinite(o."created_at") THEN (extract(epoch from o."created_at") * 1000000)::int8 WHEN o."created_at" > 'epoch' THEN 9223372036854775807 ELSE -9223372036854775807 - 1 END, ((SELECT mx."max_retry_count" + 1 FROM "public"."event_type" mx WHERE mx."code" = o."type_code"))::int8, NULL::text, NULL::text FROM "public"."event" o WHERE :condition ORDER BY o."id" LIMIT $n FOR UPDATE SKIP LOCKED

-- export, Postgres: claim_and_mark
WITH l AS (SELECT o."id" AS id FROM "public"."event" o WHERE :condition
                         ORDER BY o."id" LIMIT $n FOR UPDATE SKIP LOCKED),
                  u AS (SELECT x.id, x.k, row_number() OVER () AS n
                          FROM (SELECT o."id" AS id, 'row:' || (o."id")::text AS k FROM "public"."event" o WHERE :condition
                                 ORDER BY o."id" LIMIT $n) x),
                  passed AS (SELECT k, min(n) AS n FROM u
                              WHERE NOT EXISTS (SELECT 1 FROM l WHERE l.id = u.id) GROUP BY k),
                  c AS (SELECT u.id, u.n FROM u JOIN l ON l.id = u.id
                          LEFT JOIN passed ON passed.k IS NOT DISTINCT FROM u.k
                         WHERE passed.n IS NULL OR u.n < passed.n)
             UPDATE "public"."event" o SET "status" = 'PROCESSING', "updated_at" = now() FROM c
              WHERE o."id" = c.id AND $node IS NOT NULL AND $lease >= 0
             RETURNING (o."id")::int8, NULL::text, (o."type_code")::text, NULL::text, (o."type_code")::text, (o."payload")::text, NULL::text, NULL::text, NULL::int8, (o."processing_retries_count")::int8, CASE WHEN isfinite(o."created_at") THEN (extract(epoch from o."created_at") * 1000000)::int8 WHEN o."created_at" > 'epoch' THEN 9223372036854775807 ELSE -9223372036854775807 - 1 END, ((SELECT mx."max_retry_count" + 1 FROM "public"."event_type" mx WHERE mx."code" = o."type_code"))::int8, NULL::text, NULL::text, c.n

-- export, Postgres: claim_order_column
14

-- export, Postgres: at_micros
to_timestamp(:micros::float8 / 1e6)

-- export, Postgres: destination_is
(o."type_code")::text = :destination

-- export, Postgres: delivered_between
(o."status" = 'DONE') AND o."created_at" >= to_timestamp(:since::float8 / 1e6) AND o."created_at" < to_timestamp(:until::float8 / 1e6)

-- export, Postgres: delivered_before
(o."status" = 'DONE') AND o."updated_at" < to_timestamp(:before::float8 / 1e6)

-- export, Postgres: dead_before
(o."status" = 'ERROR') AND o."updated_at" < to_timestamp(:before::float8 / 1e6)

-- export, Postgres: release_unheld
UPDATE "public"."event" o SET "status" = 'NEW', "updated_at" = now() WHERE o."status" = 'PROCESSING' AND :node IS NOT NULL AND :not_held

-- export, Postgres: count
SELECT (count(*))::int8 FROM "public"."event" o WHERE :condition

-- export, Postgres: pick
SELECT (o."id")::text FROM "public"."event" o WHERE :condition ORDER BY o."id" LIMIT $n

-- export, Postgres: delete
DELETE FROM "public"."event" WHERE "id" = ANY($ids)

-- export, Postgres: delete_dead_records
DELETE FROM "public"."event_dead_letters" WHERE id = ANY($ids)

-- export, Postgres: retry
UPDATE "public"."event" o SET "status" = 'NEW', "processing_retries_count" = :attempts, "updated_at" = now() WHERE o."id" = :id AND o."status" = 'PROCESSING' AND $node IS NOT NULL AND :attempts >= 0 AND :error IS NOT NULL AND :delay >= 0

-- export, Postgres: dead_letter
UPDATE "public"."event" o SET "status" = 'ERROR', "processing_retries_count" = :attempts, "updated_at" = now() WHERE o."id" = :id AND o."status" = 'PROCESSING' AND $node IS NOT NULL AND :attempts >= 0 AND :error IS NOT NULL

-- export, Postgres: columns_query
SELECT (column_name)::text, (data_type)::text FROM information_schema.columns WHERE table_schema = $1::text AND table_name = $2::text

-- export, Postgres: column_length_query
SELECT (character_maximum_length)::int8, (character_octet_length)::int8 FROM information_schema.columns WHERE table_schema = $3::text AND table_name = $4::text AND column_name = $5::text

-- export, Postgres: unique_column_query
SELECT count(*)::int8 FROM pg_index i JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0] WHERE i.indrelid = to_regclass($6::text) AND i.indisunique AND i.indnkeyatts = 1 AND i.indpred IS NULL AND a.attname = $7::text

-- export, Postgres: insert
INSERT INTO "public"."event" ("id", "type_code") VALUES ($1, $2) RETURNING "id"

-- export, Postgres: not_in_ids
o."id" NOT IN (SELECT unnest($8::int8[]))

-- export, Postgres: not_in_texts
'row:' || (o."id")::text NOT IN (SELECT unnest($9::text[]))

-- export, MySql: table
`public`.`event`

-- export, MySql: dead_table
`public`.`event_dead_letters`

-- export, MySql: now
UTC_TIMESTAMP(6)

-- export, MySql: id_expr
(o.`id` + 0)

-- export, MySql: key_expr
CONCAT('row:', CAST(o.`id` AS CHAR))

-- export, MySql: select_list
(o.`id` + 0), NULL, CAST(o.`type_code` AS CHAR), NULL, CAST(o.`type_code` AS CHAR), o.`payload`, NULL, NULL, NULL, CAST(o.`processing_retries_count` AS SIGNED), TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', o.`created_at`), CAST((SELECT mx.`max_retry_count` + 1 FROM `public`.`event_type` mx WHERE mx.`code` = o.`type_code`) AS SIGNED), NULL, NULL

-- export, MySql: pending
o.`status` IN ('NEW', 'PROCESSING')

-- export, MySql: dead
o.`status` = 'ERROR'

-- export, MySql: delivered
o.`status` = 'DONE'

-- export, MySql: claimable
o.`status` = 'NEW'

-- export, MySql: order_by
o.`id`

-- export, MySql: claim_set
`status` = 'PROCESSING', `updated_at` = UTC_TIMESTAMP(6)

-- export, MySql: fence
o.`status` = 'PROCESSING' AND :node IS NOT NULL

-- export, MySql: ack
UPDATE `public`.`event` o SET o.`status` = 'DONE', o.`updated_at` = UTC_TIMESTAMP(6) WHERE o.`id` IN (1, 2) AND o.`status` = 'PROCESSING' AND :node IS NOT NULL ORDER BY `id` LIMIT 2

-- export, MySql: retry_set
`status` = 'NEW', `processing_retries_count` = :attempts, `updated_at` = UTC_TIMESTAMP(6)

-- export, MySql: dead_set
`status` = 'ERROR', `processing_retries_count` = :attempts, `updated_at` = UTC_TIMESTAMP(6)

-- export, MySql: release
UPDATE `public`.`event` o SET o.`status` = 'NEW', o.`updated_at` = UTC_TIMESTAMP(6) WHERE o.`id` IN (1, 2) AND o.`status` = 'PROCESSING' AND :node IS NOT NULL

-- export, MySql: release unheld
UPDATE `public`.`event` o SET o.`status` = 'NEW', o.`updated_at` = UTC_TIMESTAMP(6) WHERE o.`status` = 'PROCESSING' AND :node IS NOT NULL AND :not_held

-- export, MySql: extend
UPDATE `public`.`event` o SET o.`updated_at` = UTC_TIMESTAMP(6) WHERE o.`id` IN (1, 2) AND o.`status` = 'PROCESSING' AND :node IS NOT NULL AND :lease >= 0

-- export, MySql: reap to pending
UPDATE `public`.`event` o SET o.`status` = 'NEW', o.`processing_retries_count` = o.`processing_retries_count` + 1, o.`updated_at` = UTC_TIMESTAMP(6) WHERE o.`status` = 'PROCESSING' AND (:all OR o.`updated_at` < UTC_TIMESTAMP(6) - INTERVAL (:lease * 1000) MICROSECOND) AND o.`processing_retries_count` + 1 < coalesce((SELECT mx.`max_retry_count` + 1 FROM `public`.`event_type` mx WHERE mx.`code` = o.`type_code`), :max) AND :lease >= 0

-- export, MySql: reap to dead
UPDATE `public`.`event` o SET o.`status` = 'ERROR', o.`processing_retries_count` = o.`processing_retries_count` + 1, o.`updated_at` = UTC_TIMESTAMP(6) WHERE o.`status` = 'PROCESSING' AND (:all OR o.`updated_at` < UTC_TIMESTAMP(6) - INTERVAL (:lease * 1000) MICROSECOND) AND o.`processing_retries_count` + 1 >= coalesce((SELECT mx.`max_retry_count` + 1 FROM `public`.`event_type` mx WHERE mx.`code` = o.`type_code`), :max) AND :lease >= 0

-- export, MySql: stats
SELECT CAST(coalesce(sum(CASE WHEN o.`status` IN ('NEW', 'PROCESSING') THEN 1 ELSE 0 END), 0) AS SIGNED), CAST(coalesce(sum(CASE WHEN (o.`status` IN ('NEW', 'PROCESSING')) AND o.`processing_retries_count` > 0 THEN 1 ELSE 0 END), 0) AS SIGNED), CAST(coalesce(sum(CASE WHEN o.`status` = 'ERROR' THEN 1 ELSE 0 END), 0) AS SIGNED), CAST(TIMESTAMPDIFF(MICROSECOND, min(CASE WHEN o.`status` IN ('NEW', 'PROCESSING') THEN o.`created_at` END), UTC_TIMESTAMP(6)) / 1000 AS SIGNED) FROM `public`.`event` o WHERE (o.`status` IN ('NEW', 'PROCESSING')) OR (o.`status` = 'ERROR')

-- export, MySql: stats by destination
SELECT CAST(o.`type_code` AS CHAR), CAST(coalesce(sum(CASE WHEN o.`status` IN ('NEW', 'PROCESSING') THEN 1 ELSE 0 END), 0) AS SIGNED), CAST(coalesce(sum(CASE WHEN (o.`status` IN ('NEW', 'PROCESSING')) AND o.`processing_retries_count` > 0 THEN 1 ELSE 0 END), 0) AS SIGNED), CAST(coalesce(sum(CASE WHEN o.`status` = 'ERROR' THEN 1 ELSE 0 END), 0) AS SIGNED), CAST(TIMESTAMPDIFF(MICROSECOND, min(CASE WHEN o.`status` IN ('NEW', 'PROCESSING') THEN o.`created_at` END), UTC_TIMESTAMP(6)) / 1000 AS SIGNED) FROM `public`.`event` o WHERE (o.`status` IN ('NEW', 'PROCESSING')) OR (o.`status` = 'ERROR') GROUP BY CAST(o.`type_code` AS CHAR) ORDER BY CAST(o.`type_code` AS CHAR)

-- export, MySql: dead_list
SELECT CAST(o.`id` AS CHAR), NULL, CAST(o.`type_code` AS CHAR), CAST(o.`type_code` AS CHAR), CAST(o.`processing_retries_count` AS SIGNED), NULL, TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', o.`updated_at`) FROM `public`.`event` o WHERE o.`status` = 'ERROR' AND :filter ORDER BY o.`id` LIMIT :n

-- export, MySql: event
SELECT (o.`id` + 0), NULL, CAST(o.`type_code` AS CHAR), NULL, CAST(o.`type_code` AS CHAR), o.`payload`, NULL, NULL, NULL, CAST(o.`processing_retries_count` AS SIGNED), TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', o.`created_at`), CAST((SELECT mx.`max_retry_count` + 1 FROM `public`.`event_type` mx WHERE mx.`code` = o.`type_code`) AS SIGNED), NULL, NULL, CAST((CASE WHEN o.`status` = 'ERROR' THEN 2 WHEN o.`status` = 'DONE' THEN 1 ELSE 0 END) AS SIGNED), CAST(o.`processing_retries_count` AS SIGNED), NULL, TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', o.`updated_at`) FROM `public`.`event` o WHERE :condition

-- export, MySql: dead_retry
UPDATE `public`.`event` o SET o.`status` = 'NEW', o.`processing_retries_count` = 0, o.`updated_at` = UTC_TIMESTAMP(6) WHERE (o.`status` = 'ERROR') AND :condition

-- export, MySql: destination_text
CAST(o.`type_code` AS CHAR)

-- export, MySql: delivered_time
o.`updated_at`

-- export, MySql: dead_time
o.`updated_at`

-- export, MySql: created_at
o.`created_at`

-- export, MySql: replay_set
`status` = 'NEW', `processing_retries_count` = 0, `updated_at` = UTC_TIMESTAMP(6)

-- export, MySql: dead_table_ddl
(none)

-- export, MySql: ddl
DO $create_schema$ BEGIN IF to_regnamespace('"public"') IS NULL THEN CREATE SCHEMA "public"; END IF; END $create_schema$;
CREATE TABLE IF NOT EXISTS "public"."event_type" (
    code text PRIMARY KEY,
    max_retry_count integer NOT NULL
);
CREATE TABLE IF NOT EXISTS "public"."event" (
    id bigserial PRIMARY KEY,
    type_code text NOT NULL REFERENCES "public"."event_type" (code),
    payload jsonb NOT NULL,
    status text NOT NULL DEFAULT 'NEW',
    processing_retries_count integer NOT NULL DEFAULT 0,
    created_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    updated_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
DO $relay$ BEGIN IF to_regclass('"public"."event_new_idx"') IS NULL THEN CREATE INDEX "event_new_idx" ON "public"."event" (id) WHERE status = 'NEW'; END IF; END $relay$;
DO $relay$ BEGIN IF to_regclass('"public"."event_processing_idx"') IS NULL THEN CREATE INDEX "event_processing_idx" ON "public"."event" (updated_at) WHERE status = 'PROCESSING'; END IF; END $relay$;


-- export, MySql: grants
GRANT SELECT, UPDATE ON `public`.`event` TO 'relay'@'%';
GRANT SELECT ON `public`.`event_type` TO 'relay'@'%';
-- Operators (`dead purge`, `prune`) also need DELETE on `public`.`event`.


-- export, MySql: claim_select
SELECT (o.`id` + 0), NULL, CAST(o.`type_code` AS CHAR), NULL, CAST(o.`type_code` AS CHAR), o.`payload`, NULL, NULL, NULL, CAST(o.`processing_retries_count` AS SIGNED), TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', o.`created_at`), CAST((SELECT mx.`max_retry_count` + 1 FROM `public`.`event_type` mx WHERE mx.`code` = o.`type_code`) AS SIGNED), NULL, NULL FROM `public`.`event` o WHERE :condition ORDER BY o.`id` LIMIT :n

-- export, MySql: claim_select locking
SELECT (o.`id` + 0), NULL, CAST(o.`type_code` AS CHAR), NULL, CAST(o.`type_code` AS CHAR), o.`payload`, NULL, NULL, NULL, CAST(o.`processing_retries_count` AS SIGNED), TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', o.`created_at`), CAST((SELECT mx.`max_retry_count` + 1 FROM `public`.`event_type` mx WHERE mx.`code` = o.`type_code`) AS SIGNED), NULL, NULL FROM `public`.`event` o WHERE :condition ORDER BY o.`id` LIMIT :n FOR UPDATE SKIP LOCKED

-- export, MySql: claim_and_mark
WITH l AS (SELECT o.`id` AS id FROM `public`.`event` o WHERE :condition
                         ORDER BY o.`id` LIMIT :n FOR UPDATE SKIP LOCKED),
                  u AS (SELECT x.id, x.k, row_number() OVER () AS n
                          FROM (SELECT o.`id` AS id, CONCAT('row:', CAST(o.`id` AS CHAR)) AS k FROM `public`.`event` o WHERE :condition
                                 ORDER BY o.`id` LIMIT :n) x),
                  passed AS (SELECT k, min(n) AS n FROM u
                              WHERE NOT EXISTS (SELECT 1 FROM l WHERE l.id = u.id) GROUP BY k),
                  c AS (SELECT u.id, u.n FROM u JOIN l ON l.id = u.id
                          LEFT JOIN passed ON passed.k IS NOT DISTINCT FROM u.k
                         WHERE passed.n IS NULL OR u.n < passed.n)
             UPDATE `public`.`event` o SET `status` = 'PROCESSING', `updated_at` = UTC_TIMESTAMP(6) FROM c
              WHERE o.`id` = c.id AND :node IS NOT NULL AND :lease >= 0
             RETURNING (o.`id` + 0), NULL, CAST(o.`type_code` AS CHAR), NULL, CAST(o.`type_code` AS CHAR), o.`payload`, NULL, NULL, NULL, CAST(o.`processing_retries_count` AS SIGNED), TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', o.`created_at`), CAST((SELECT mx.`max_retry_count` + 1 FROM `public`.`event_type` mx WHERE mx.`code` = o.`type_code`) AS SIGNED), NULL, NULL, c.n

-- export, MySql: claim_order_column
14

-- export, MySql: at_micros
FROM_UNIXTIME(:micros / 1000000)

-- export, MySql: destination_is
CAST(CAST(o.`type_code` AS CHAR) AS BINARY) = CAST(:destination AS BINARY)

-- export, MySql: delivered_between
(o.`status` = 'DONE') AND o.`created_at` >= FROM_UNIXTIME(:since / 1000000) AND o.`created_at` < FROM_UNIXTIME(:until / 1000000)

-- export, MySql: delivered_before
(o.`status` = 'DONE') AND o.`updated_at` < FROM_UNIXTIME(:before / 1000000)

-- export, MySql: dead_before
(o.`status` = 'ERROR') AND o.`updated_at` < FROM_UNIXTIME(:before / 1000000)

-- export, MySql: release_unheld
UPDATE `public`.`event` o SET o.`status` = 'NEW', o.`updated_at` = UTC_TIMESTAMP(6) WHERE o.`status` = 'PROCESSING' AND :node IS NOT NULL AND :not_held

-- export, MySql: count
SELECT CAST(count(*) AS SIGNED) FROM `public`.`event` o WHERE :condition

-- export, MySql: pick
SELECT CAST(o.`id` AS CHAR) FROM `public`.`event` o WHERE :condition ORDER BY o.`id` LIMIT :n

-- export, MySql: delete
DELETE FROM `public`.`event` WHERE `id` IN (1, 2)

-- export, MySql: delete_dead_records
DELETE FROM `public`.`event_dead_letters` WHERE id IN (1, 2)

-- export, MySql: retry
UPDATE `public`.`event` o SET o.`status` = 'NEW', o.`processing_retries_count` = :attempts, o.`updated_at` = UTC_TIMESTAMP(6) WHERE o.`id` = :id AND o.`status` = 'PROCESSING' AND :node IS NOT NULL AND :attempts >= 0 AND :error IS NOT NULL AND :delay >= 0

-- export, MySql: dead_letter
UPDATE `public`.`event` o SET o.`status` = 'ERROR', o.`processing_retries_count` = :attempts, o.`updated_at` = UTC_TIMESTAMP(6) WHERE o.`id` = :id AND o.`status` = 'PROCESSING' AND :node IS NOT NULL AND :attempts >= 0 AND :error IS NOT NULL

-- export, MySql: columns_query
SELECT CAST(column_name AS CHAR), CAST(data_type AS CHAR) FROM information_schema.columns WHERE table_schema = :p1 AND table_name = :p2

-- export, MySql: column_length_query
SELECT CAST(character_maximum_length AS SIGNED), CAST(character_octet_length AS SIGNED) FROM information_schema.columns WHERE table_schema = :p3 AND table_name = :p4 AND column_name = :p5

-- export, MySql: unique_column_query
SELECT CAST(COUNT(*) AS SIGNED) FROM (SELECT index_name FROM information_schema.statistics WHERE table_schema = :p6 AND table_name = :p7 AND non_unique = 0 GROUP BY index_name HAVING COUNT(*) = 1 AND MAX(column_name) = :p8 AND MAX(sub_part) IS NULL) u

-- export, MySql: insert
INSERT INTO `public`.`event` (`id`, `type_code`) VALUES (?, ?)

-- export, MySql: not_in_ids
o.`id` NOT IN (1, 2)

-- export, MySql: not_in_texts
CAST(CONCAT('row:', CAST(o.`id` AS CHAR)) AS BINARY) NOT IN (CAST(:p9 AS BINARY), CAST(:p10 AS BINARY))

-- debezium, Postgres: table
"public"."outboxevent"

-- debezium, Postgres: dead_table
"public"."outboxevent_dead_letters"

-- debezium, Postgres: now
(now() AT TIME ZONE 'UTC')

-- debezium, Postgres: id_expr
(o."relay_sequence")::int8

-- debezium, Postgres: key_expr
coalesce((o."aggregateid")::text, (o."aggregatetype")::text)

-- debezium, Postgres: select_list
(o."relay_sequence")::int8, (o."id")::text, (o."aggregatetype")::text, (o."aggregateid")::text, (o."type")::text, (o."payload")::text, NULL::text, NULL::text, NULL::int8, NULL::int8, CASE WHEN isfinite(o."timestamp") THEN (extract(epoch from o."timestamp") * 1000000)::int8 WHEN o."timestamp" > 'epoch' THEN 9223372036854775807 ELSE -9223372036854775807 - 1 END, NULL::int8, (o."tracingspancontext")::text, NULL::text

-- debezium, Postgres: pending
NOT EXISTS (SELECT 1 FROM "public"."outboxevent_dead_letters" dl WHERE dl.id = o."relay_sequence")

-- debezium, Postgres: dead
EXISTS (SELECT 1 FROM "public"."outboxevent_dead_letters" dl WHERE dl.id = o."relay_sequence")

-- debezium, Postgres: delivered
(none)

-- debezium, Postgres: claimable
NOT EXISTS (SELECT 1 FROM "public"."outboxevent_dead_letters" dl WHERE dl.id = o."relay_sequence")

-- debezium, Postgres: order_by
o."relay_sequence"

-- debezium, Postgres: claim_set


-- debezium, Postgres: fence
$node IS NOT NULL

-- debezium, Postgres: ack
DELETE FROM "public"."outboxevent" o WHERE o."relay_sequence" = ANY($ids) AND $node IS NOT NULL

-- debezium, Postgres: retry_set


-- debezium, Postgres: dead_set


-- debezium, Postgres: release
(none)

-- debezium, Postgres: release unheld
(none)

-- debezium, Postgres: extend
(none)

-- debezium, Postgres: reap to pending
(none)

-- debezium, Postgres: reap to dead
(none)

-- debezium, Postgres: stats
SELECT (coalesce(sum(CASE WHEN NOT EXISTS (SELECT 1 FROM "public"."outboxevent_dead_letters" dl WHERE dl.id = o."relay_sequence") THEN 1 ELSE 0 END), 0))::int8, (coalesce(sum(CASE WHEN false THEN 1 ELSE 0 END), 0))::int8, (coalesce(sum(CASE WHEN EXISTS (SELECT 1 FROM "public"."outboxevent_dead_letters" dl WHERE dl.id = o."relay_sequence") THEN 1 ELSE 0 END), 0))::int8, (extract(epoch from (now() AT TIME ZONE 'UTC') - min(CASE WHEN NOT EXISTS (SELECT 1 FROM "public"."outboxevent_dead_letters" dl WHERE dl.id = o."relay_sequence") AND isfinite(o."timestamp") THEN o."timestamp" END)) * 1000)::int8 FROM "public"."outboxevent" o WHERE (NOT EXISTS (SELECT 1 FROM "public"."outboxevent_dead_letters" dl WHERE dl.id = o."relay_sequence")) OR (EXISTS (SELECT 1 FROM "public"."outboxevent_dead_letters" dl WHERE dl.id = o."relay_sequence"))

-- debezium, Postgres: stats by destination
SELECT (o."aggregatetype")::text, (coalesce(sum(CASE WHEN NOT EXISTS (SELECT 1 FROM "public"."outboxevent_dead_letters" dl WHERE dl.id = o."relay_sequence") THEN 1 ELSE 0 END), 0))::int8, (coalesce(sum(CASE WHEN false THEN 1 ELSE 0 END), 0))::int8, (coalesce(sum(CASE WHEN EXISTS (SELECT 1 FROM "public"."outboxevent_dead_letters" dl WHERE dl.id = o."relay_sequence") THEN 1 ELSE 0 END), 0))::int8, (extract(epoch from (now() AT TIME ZONE 'UTC') - min(CASE WHEN NOT EXISTS (SELECT 1 FROM "public"."outboxevent_dead_letters" dl WHERE dl.id = o."relay_sequence") AND isfinite(o."timestamp") THEN o."timestamp" END)) * 1000)::int8 FROM "public"."outboxevent" o WHERE (NOT EXISTS (SELECT 1 FROM "public"."outboxevent_dead_letters" dl WHERE dl.id = o."relay_sequence")) OR (EXISTS (SELECT 1 FROM "public"."outboxevent_dead_letters" dl WHERE dl.id = o."relay_sequence")) GROUP BY (o."aggregatetype")::text ORDER BY (o."aggregatetype")::text

-- debezium, Postgres: dead_list
SELECT (o."relay_sequence")::text, (o."id")::text, (o."aggregatetype")::text, (o."type")::text, ((SELECT dl.attempts FROM "public"."outboxevent_dead_letters" dl WHERE dl.id = o."relay_sequence"))::int8, ((SELECT dl.last_error FROM "public"."outboxevent_dead_letters" dl WHERE dl.id = o."relay_sequence"))::text, CASE WHEN isfinite((SELECT dl.dead_at FROM "public"."outboxevent_dead_letters" dl WHERE dl.id = o."relay_sequence")) THEN (extract(epoch from (SELECT dl.dead_at FROM "public"."outboxevent_dead_letters" dl WHERE dl.id = o."relay_sequence")) * 1000000)::int8 WHEN (SELECT dl.dead_at FROM "public"."outboxevent_dead_letters" dl WHERE dl.id = o."relay_sequence") > 'epoch' THEN 9223372036854775807 ELSE -9223372036854775807 - 1 END FROM "public"."outboxevent" o WHERE EXISTS (SELECT 1 FROM "public"."outboxevent_dead_letters" dl WHERE dl.id = o."relay_sequence") AND :filter ORDER BY o."relay_sequence" LIMIT $n

-- debezium, Postgres: event
SELECT (o."relay_sequence")::int8, (o."id")::text, (o."aggregatetype")::text, (o."aggregateid")::text, (o."type")::text, (o."payload")::text, NULL::text, NULL::text, NULL::int8, NULL::int8, CASE WHEN isfinite(o."timestamp") THEN (extract(epoch from o."timestamp") * 1000000)::int8 WHEN o."timestamp" > 'epoch' THEN 9223372036854775807 ELSE -9223372036854775807 - 1 END, NULL::int8, (o."tracingspancontext")::text, NULL::text, ((CASE WHEN EXISTS (SELECT 1 FROM "public"."outboxevent_dead_letters" dl WHERE dl.id = o."relay_sequence") THEN 2 WHEN 1 = 0 THEN 1 ELSE 0 END))::int8, ((SELECT dl.attempts FROM "public"."outboxevent_dead_letters" dl WHERE dl.id = o."relay_sequence"))::int8, ((SELECT dl.last_error FROM "public"."outboxevent_dead_letters" dl WHERE dl.id = o."relay_sequence"))::text, CASE WHEN isfinite((SELECT dl.dead_at FROM "public"."outboxevent_dead_letters" dl WHERE dl.id = o."relay_sequence")) THEN (extract(epoch from (SELECT dl.dead_at FROM "public"."outboxevent_dead_letters" dl WHERE dl.id = o."relay_sequence")) * 1000000)::int8 WHEN (SELECT dl.dead_at FROM "public"."outboxevent_dead_letters" dl WHERE dl.id = o."relay_sequence") > 'epoch' THEN 9223372036854775807 ELSE -9223372036854775807 - 1 END FROM "public"."outboxevent" o WHERE :condition

-- debezium, Postgres: dead_retry
(none)

-- debezium, Postgres: destination_text
(o."aggregatetype")::text

-- debezium, Postgres: delivered_time
o."timestamp"

-- debezium, Postgres: dead_time
(SELECT dl.dead_at FROM "public"."outboxevent_dead_letters" dl WHERE dl.id = o."relay_sequence")

-- debezium, Postgres: created_at
o."timestamp"

-- debezium, Postgres: replay_set


-- debezium, Postgres: dead_table_ddl
-- Dead events of a layout that cannot mark them; the outbox row itself is left as it is.
CREATE TABLE IF NOT EXISTS "public"."outboxevent_dead_letters" (
    id bigint PRIMARY KEY,
    attempts integer NOT NULL,
    last_error text NOT NULL,
    dead_at timestamptz NOT NULL DEFAULT now()
);


-- debezium, Postgres: ddl
DO $create_schema$ BEGIN IF to_regnamespace('"public"') IS NULL THEN CREATE SCHEMA "public"; END IF; END $create_schema$;
CREATE TABLE IF NOT EXISTS "public"."outboxevent" (
    id uuid NOT NULL PRIMARY KEY,
    aggregatetype varchar(255) NOT NULL,
    aggregateid varchar(255) NOT NULL,
    type varchar(255) NOT NULL,
    "timestamp" timestamp NOT NULL DEFAULT (now() AT TIME ZONE 'utc'),
    payload jsonb,
    tracingspancontext varchar(256)
);
DO $relay$ BEGIN IF NOT EXISTS (SELECT 1 FROM information_schema.columns WHERE table_schema = 'public' AND table_name = 'outboxevent' AND column_name = 'timestamp') THEN ALTER TABLE "public"."outboxevent" ADD COLUMN "timestamp" timestamp NOT NULL DEFAULT (now() AT TIME ZONE 'utc'); END IF; END $relay$;
DO $relay$ BEGIN IF NOT EXISTS (SELECT 1 FROM information_schema.columns WHERE table_schema = 'public' AND table_name = 'outboxevent' AND column_name = 'tracingspancontext') THEN ALTER TABLE "public"."outboxevent" ADD COLUMN "tracingspancontext" varchar(256); END IF; END $relay$;
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM information_schema.columns WHERE table_schema = 'public' AND table_name = 'outboxevent' AND column_name = 'relay_sequence') THEN
        IF EXISTS (SELECT 1 FROM "public"."outboxevent") THEN
            RAISE EXCEPTION 'outboxevent holds rows, and Debezium never deletes the rows it relays, so these were most likely published already; relayed again they would go out twice, in an order the table cannot give (its id is random, its timestamp ties). Stop Debezium once it has caught up, delete them (DELETE FROM "public"."outboxevent"), and run migrate again; to relay them anyway, add the column first (ALTER TABLE "public"."outboxevent" ADD COLUMN relay_sequence bigserial), which numbers them in the table''s physical order';
        END IF;
        ALTER TABLE "public"."outboxevent" ADD COLUMN relay_sequence bigserial;
    END IF;
END
$$;
DO $relay$ BEGIN IF to_regclass('"public"."outboxevent_relay_sequence_key"') IS NULL THEN CREATE UNIQUE INDEX "outboxevent_relay_sequence_key" ON "public"."outboxevent" (relay_sequence); END IF; END $relay$;
-- Dead events of a layout that cannot mark them; the outbox row itself is left as it is.
CREATE TABLE IF NOT EXISTS "public"."outboxevent_dead_letters" (
    id bigint PRIMARY KEY,
    attempts integer NOT NULL,
    last_error text NOT NULL,
    dead_at timestamptz NOT NULL DEFAULT now()
);


-- debezium, Postgres: grants
GRANT SELECT, UPDATE, DELETE ON "public"."outboxevent" TO "relay";
GRANT SELECT, INSERT, DELETE ON "public"."outboxevent_dead_letters" TO "relay";
-- Operators (`dead purge`, `prune`) also need DELETE on "public"."outboxevent".


-- debezium, Postgres: claim_select
SELECT (o."relay_sequence")::int8, (o."id")::text, (o."aggregatetype")::text, (o."aggregateid")::text, (o."type")::text, (o."payload")::text, NULL::text, NULL::text, NULL::int8, NULL::int8, CASE WHEN isfinite(o."timestamp") THEN (extract(epoch from o."timestamp") * 1000000)::int8 WHEN o."timestamp" > 'epoch' THEN 9223372036854775807 ELSE -9223372036854775807 - 1 END, NULL::int8, (o."tracingspancontext")::text, NULL::text FROM "public"."outboxevent" o WHERE :condition ORDER BY o."relay_sequence" LIMIT $n

-- debezium, Postgres: claim_select locking
SELECT (o."relay_sequence")::int8, (o."id")::text, (o."aggregatetype")::text, (o."aggregateid")::text, (o."type")::text, (o."payload")::text, NULL::text, NULL::text, NULL::int8, NULL::int8, CASE WHEN isfinite(o."timestamp") THEN (extract(epoch from o."timestamp") * 1000000)::int8 WHEN o."timestamp" > 'epoch' THEN 9223372036854775807 ELSE -9223372036854775807 - 1 END, NULL::int8, (o."tracingspancontext")::text, NULL::text FROM "public"."outboxevent" o WHERE :condition ORDER BY o."relay_sequence" LIMIT $n FOR UPDATE SKIP LOCKED

-- debezium, Postgres: claim_and_mark
WITH l AS (SELECT o."relay_sequence" AS id FROM "public"."outboxevent" o WHERE :condition
                         ORDER BY o."relay_sequence" LIMIT $n FOR UPDATE SKIP LOCKED),
                  u AS (SELECT x.id, x.k, row_number() OVER () AS n
                          FROM (SELECT o."relay_sequence" AS id, coalesce((o."aggregateid")::text, (o."aggregatetype")::text) AS k FROM "public"."outboxevent" o WHERE :condition
                                 ORDER BY o."relay_sequence" LIMIT $n) x),
                  passed AS (SELECT k, min(n) AS n FROM u
                              WHERE NOT EXISTS (SELECT 1 FROM l WHERE l.id = u.id) GROUP BY k),
                  c AS (SELECT u.id, u.n FROM u JOIN l ON l.id = u.id
                          LEFT JOIN passed ON passed.k IS NOT DISTINCT FROM u.k
                         WHERE passed.n IS NULL OR u.n < passed.n)
             UPDATE "public"."outboxevent" o SET  FROM c
              WHERE o."relay_sequence" = c.id AND $node IS NOT NULL AND $lease >= 0
             RETURNING (o."relay_sequence")::int8, (o."id")::text, (o."aggregatetype")::text, (o."aggregateid")::text, (o."type")::text, (o."payload")::text, NULL::text, NULL::text, NULL::int8, NULL::int8, CASE WHEN isfinite(o."timestamp") THEN (extract(epoch from o."timestamp") * 1000000)::int8 WHEN o."timestamp" > 'epoch' THEN 9223372036854775807 ELSE -9223372036854775807 - 1 END, NULL::int8, (o."tracingspancontext")::text, NULL::text, c.n

-- debezium, Postgres: claim_order_column
14

-- debezium, Postgres: at_micros
(to_timestamp(:micros::float8 / 1e6) AT TIME ZONE 'UTC')

-- debezium, Postgres: destination_is
(o."aggregatetype")::text = :destination

-- debezium, Postgres: delivered_between
(none)

-- debezium, Postgres: delivered_before
(none)

-- debezium, Postgres: dead_before
(EXISTS (SELECT 1 FROM "public"."outboxevent_dead_letters" dl WHERE dl.id = o."relay_sequence")) AND (SELECT dl.dead_at FROM "public"."outboxevent_dead_letters" dl WHERE dl.id = o."relay_sequence") < (to_timestamp(:before::float8 / 1e6) AT TIME ZONE 'UTC')

-- debezium, Postgres: release_unheld
(none)

-- debezium, Postgres: count
SELECT (count(*))::int8 FROM "public"."outboxevent" o WHERE :condition

-- debezium, Postgres: pick
SELECT (o."relay_sequence")::text FROM "public"."outboxevent" o WHERE :condition ORDER BY o."relay_sequence" LIMIT $n

-- debezium, Postgres: delete
DELETE FROM "public"."outboxevent" WHERE "relay_sequence" = ANY($ids)

-- debezium, Postgres: delete_dead_records
DELETE FROM "public"."outboxevent_dead_letters" WHERE id = ANY($ids)

-- debezium, Postgres: retry
(none)

-- debezium, Postgres: dead_letter
INSERT INTO "public"."outboxevent_dead_letters" (id, attempts, last_error)
                 SELECT o."relay_sequence", :attempts, :error FROM "public"."outboxevent" o WHERE o."relay_sequence" = :id AND $node IS NOT NULL
                 ON CONFLICT (id) DO NOTHING

-- debezium, Postgres: columns_query
SELECT (column_name)::text, (data_type)::text FROM information_schema.columns WHERE table_schema = $1::text AND table_name = $2::text

-- debezium, Postgres: column_length_query
SELECT (character_maximum_length)::int8, (character_octet_length)::int8 FROM information_schema.columns WHERE table_schema = $3::text AND table_name = $4::text AND column_name = $5::text

-- debezium, Postgres: unique_column_query
SELECT count(*)::int8 FROM pg_index i JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0] WHERE i.indrelid = to_regclass($6::text) AND i.indisunique AND i.indnkeyatts = 1 AND i.indpred IS NULL AND a.attname = $7::text

-- debezium, Postgres: insert
INSERT INTO "public"."outboxevent" ("relay_sequence", "aggregatetype", "id") VALUES ($1, $2, gen_random_uuid()) RETURNING "relay_sequence"

-- debezium, Postgres: not_in_ids
o."relay_sequence" NOT IN (SELECT unnest($8::int8[]))

-- debezium, Postgres: not_in_texts
coalesce((o."aggregateid")::text, (o."aggregatetype")::text) NOT IN (SELECT unnest($9::text[]))

-- debezium, MySql: table
`public`.`outboxevent`

-- debezium, MySql: dead_table
`public`.`outboxevent_dead_letters`

-- debezium, MySql: now
UTC_TIMESTAMP(6)

-- debezium, MySql: id_expr
(o.`relay_sequence` + 0)

-- debezium, MySql: key_expr
coalesce(CAST(o.`aggregateid` AS CHAR), CAST(o.`aggregatetype` AS CHAR))

-- debezium, MySql: select_list
(o.`relay_sequence` + 0), CAST(o.`id` AS CHAR), CAST(o.`aggregatetype` AS CHAR), CAST(o.`aggregateid` AS CHAR), CAST(o.`type` AS CHAR), o.`payload`, NULL, NULL, NULL, NULL, TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', o.`timestamp`), NULL, CAST(o.`tracingspancontext` AS CHAR), NULL

-- debezium, MySql: pending
NOT EXISTS (SELECT 1 FROM `public`.`outboxevent_dead_letters` dl WHERE dl.id = o.`relay_sequence`)

-- debezium, MySql: dead
EXISTS (SELECT 1 FROM `public`.`outboxevent_dead_letters` dl WHERE dl.id = o.`relay_sequence`)

-- debezium, MySql: delivered
(none)

-- debezium, MySql: claimable
NOT EXISTS (SELECT 1 FROM `public`.`outboxevent_dead_letters` dl WHERE dl.id = o.`relay_sequence`)

-- debezium, MySql: order_by
o.`relay_sequence`

-- debezium, MySql: claim_set


-- debezium, MySql: fence
:node IS NOT NULL

-- debezium, MySql: ack
DELETE FROM `public`.`outboxevent` WHERE `public`.`outboxevent`.`relay_sequence` IN (1, 2) AND :node IS NOT NULL ORDER BY `relay_sequence` LIMIT 2

-- debezium, MySql: retry_set


-- debezium, MySql: dead_set


-- debezium, MySql: release
(none)

-- debezium, MySql: release unheld
(none)

-- debezium, MySql: extend
(none)

-- debezium, MySql: reap to pending
(none)

-- debezium, MySql: reap to dead
(none)

-- debezium, MySql: stats
SELECT CAST(coalesce(sum(CASE WHEN NOT EXISTS (SELECT 1 FROM `public`.`outboxevent_dead_letters` dl WHERE dl.id = o.`relay_sequence`) THEN 1 ELSE 0 END), 0) AS SIGNED), CAST(coalesce(sum(CASE WHEN 1 = 0 THEN 1 ELSE 0 END), 0) AS SIGNED), CAST(coalesce(sum(CASE WHEN EXISTS (SELECT 1 FROM `public`.`outboxevent_dead_letters` dl WHERE dl.id = o.`relay_sequence`) THEN 1 ELSE 0 END), 0) AS SIGNED), CAST(TIMESTAMPDIFF(MICROSECOND, min(CASE WHEN NOT EXISTS (SELECT 1 FROM `public`.`outboxevent_dead_letters` dl WHERE dl.id = o.`relay_sequence`) THEN o.`timestamp` END), UTC_TIMESTAMP(6)) / 1000 AS SIGNED) FROM `public`.`outboxevent` o WHERE (NOT EXISTS (SELECT 1 FROM `public`.`outboxevent_dead_letters` dl WHERE dl.id = o.`relay_sequence`)) OR (EXISTS (SELECT 1 FROM `public`.`outboxevent_dead_letters` dl WHERE dl.id = o.`relay_sequence`))

-- debezium, MySql: stats by destination
SELECT CAST(o.`aggregatetype` AS CHAR), CAST(coalesce(sum(CASE WHEN NOT EXISTS (SELECT 1 FROM `public`.`outboxevent_dead_letters` dl WHERE dl.id = o.`relay_sequence`) THEN 1 ELSE 0 END), 0) AS SIGNED), CAST(coalesce(sum(CASE WHEN 1 = 0 THEN 1 ELSE 0 END), 0) AS SIGNED), CAST(coalesce(sum(CASE WHEN EXISTS (SELECT 1 FROM `public`.`outboxevent_dead_letters` dl WHERE dl.id = o.`relay_sequence`) THEN 1 ELSE 0 END), 0) AS SIGNED), CAST(TIMESTAMPDIFF(MICROSECOND, min(CASE WHEN NOT EXISTS (SELECT 1 FROM `public`.`outboxevent_dead_letters` dl WHERE dl.id = o.`relay_sequence`) THEN o.`timestamp` END), UTC_TIMESTAMP(6)) / 1000 AS SIGNED) FROM `public`.`outboxevent` o WHERE (NOT EXISTS (SELECT 1 FROM `public`.`outboxevent_dead_letters` dl WHERE dl.id = o.`relay_sequence`)) OR (EXISTS (SELECT 1 FROM `public`.`outboxevent_dead_letters` dl WHERE dl.id = o.`relay_sequence`)) GROUP BY CAST(o.`aggregatetype` AS CHAR) ORDER BY CAST(o.`aggregatetype` AS CHAR)

-- debezium, MySql: dead_list
SELECT CAST(o.`relay_sequence` AS CHAR), CAST(o.`id` AS CHAR), CAST(o.`aggregatetype` AS CHAR), CAST(o.`type` AS CHAR), CAST((SELECT dl.attempts FROM `public`.`outboxevent_dead_letters` dl WHERE dl.id = o.`relay_sequence`) AS SIGNED), CAST((SELECT dl.last_error FROM `public`.`outboxevent_dead_letters` dl WHERE dl.id = o.`relay_sequence`) AS CHAR), TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', (SELECT dl.dead_at FROM `public`.`outboxevent_dead_letters` dl WHERE dl.id = o.`relay_sequence`)) FROM `public`.`outboxevent` o WHERE EXISTS (SELECT 1 FROM `public`.`outboxevent_dead_letters` dl WHERE dl.id = o.`relay_sequence`) AND :filter ORDER BY o.`relay_sequence` LIMIT :n

-- debezium, MySql: event
SELECT (o.`relay_sequence` + 0), CAST(o.`id` AS CHAR), CAST(o.`aggregatetype` AS CHAR), CAST(o.`aggregateid` AS CHAR), CAST(o.`type` AS CHAR), o.`payload`, NULL, NULL, NULL, NULL, TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', o.`timestamp`), NULL, CAST(o.`tracingspancontext` AS CHAR), NULL, CAST((CASE WHEN EXISTS (SELECT 1 FROM `public`.`outboxevent_dead_letters` dl WHERE dl.id = o.`relay_sequence`) THEN 2 WHEN 1 = 0 THEN 1 ELSE 0 END) AS SIGNED), CAST((SELECT dl.attempts FROM `public`.`outboxevent_dead_letters` dl WHERE dl.id = o.`relay_sequence`) AS SIGNED), CAST((SELECT dl.last_error FROM `public`.`outboxevent_dead_letters` dl WHERE dl.id = o.`relay_sequence`) AS CHAR), TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', (SELECT dl.dead_at FROM `public`.`outboxevent_dead_letters` dl WHERE dl.id = o.`relay_sequence`)) FROM `public`.`outboxevent` o WHERE :condition

-- debezium, MySql: dead_retry
(none)

-- debezium, MySql: destination_text
CAST(o.`aggregatetype` AS CHAR)

-- debezium, MySql: delivered_time
o.`timestamp`

-- debezium, MySql: dead_time
(SELECT dl.dead_at FROM `public`.`outboxevent_dead_letters` dl WHERE dl.id = o.`relay_sequence`)

-- debezium, MySql: created_at
o.`timestamp`

-- debezium, MySql: replay_set


-- debezium, MySql: dead_table_ddl
-- Dead events of a layout that cannot mark them; the outbox row itself is left as it is.
CREATE TABLE IF NOT EXISTS `public`.`outboxevent_dead_letters` (
    id bigint unsigned PRIMARY KEY,
    attempts integer NOT NULL,
    last_error text NOT NULL,
    dead_at datetime(6) NOT NULL
);


-- debezium, MySql: ddl
DO $create_schema$ BEGIN IF to_regnamespace('"public"') IS NULL THEN CREATE SCHEMA "public"; END IF; END $create_schema$;
CREATE TABLE IF NOT EXISTS "public"."outboxevent" (
    id uuid NOT NULL PRIMARY KEY,
    aggregatetype varchar(255) NOT NULL,
    aggregateid varchar(255) NOT NULL,
    type varchar(255) NOT NULL,
    "timestamp" timestamp NOT NULL DEFAULT (now() AT TIME ZONE 'utc'),
    payload jsonb,
    tracingspancontext varchar(256)
);
DO $relay$ BEGIN IF NOT EXISTS (SELECT 1 FROM information_schema.columns WHERE table_schema = 'public' AND table_name = 'outboxevent' AND column_name = 'timestamp') THEN ALTER TABLE "public"."outboxevent" ADD COLUMN "timestamp" timestamp NOT NULL DEFAULT (now() AT TIME ZONE 'utc'); END IF; END $relay$;
DO $relay$ BEGIN IF NOT EXISTS (SELECT 1 FROM information_schema.columns WHERE table_schema = 'public' AND table_name = 'outboxevent' AND column_name = 'tracingspancontext') THEN ALTER TABLE "public"."outboxevent" ADD COLUMN "tracingspancontext" varchar(256); END IF; END $relay$;
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM information_schema.columns WHERE table_schema = 'public' AND table_name = 'outboxevent' AND column_name = 'relay_sequence') THEN
        IF EXISTS (SELECT 1 FROM "public"."outboxevent") THEN
            RAISE EXCEPTION 'outboxevent holds rows, and Debezium never deletes the rows it relays, so these were most likely published already; relayed again they would go out twice, in an order the table cannot give (its id is random, its timestamp ties). Stop Debezium once it has caught up, delete them (DELETE FROM "public"."outboxevent"), and run migrate again; to relay them anyway, add the column first (ALTER TABLE "public"."outboxevent" ADD COLUMN relay_sequence bigserial), which numbers them in the table''s physical order';
        END IF;
        ALTER TABLE "public"."outboxevent" ADD COLUMN relay_sequence bigserial;
    END IF;
END
$$;
DO $relay$ BEGIN IF to_regclass('"public"."outboxevent_relay_sequence_key"') IS NULL THEN CREATE UNIQUE INDEX "outboxevent_relay_sequence_key" ON "public"."outboxevent" (relay_sequence); END IF; END $relay$;
-- Dead events of a layout that cannot mark them; the outbox row itself is left as it is.
CREATE TABLE IF NOT EXISTS `public`.`outboxevent_dead_letters` (
    id bigint unsigned PRIMARY KEY,
    attempts integer NOT NULL,
    last_error text NOT NULL,
    dead_at datetime(6) NOT NULL
);


-- debezium, MySql: grants
GRANT SELECT, UPDATE, DELETE ON `public`.`outboxevent` TO 'relay'@'%';
GRANT SELECT, INSERT, DELETE ON `public`.`outboxevent_dead_letters` TO 'relay'@'%';
-- Operators (`dead purge`, `prune`) also need DELETE on `public`.`outboxevent`.


-- debezium, MySql: claim_select
SELECT (o.`relay_sequence` + 0), CAST(o.`id` AS CHAR), CAST(o.`aggregatetype` AS CHAR), CAST(o.`aggregateid` AS CHAR), CAST(o.`type` AS CHAR), o.`payload`, NULL, NULL, NULL, NULL, TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', o.`timestamp`), NULL, CAST(o.`tracingspancontext` AS CHAR), NULL FROM `public`.`outboxevent` o WHERE :condition ORDER BY o.`relay_sequence` LIMIT :n

-- debezium, MySql: claim_select locking
SELECT (o.`relay_sequence` + 0), CAST(o.`id` AS CHAR), CAST(o.`aggregatetype` AS CHAR), CAST(o.`aggregateid` AS CHAR), CAST(o.`type` AS CHAR), o.`payload`, NULL, NULL, NULL, NULL, TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', o.`timestamp`), NULL, CAST(o.`tracingspancontext` AS CHAR), NULL FROM `public`.`outboxevent` o WHERE :condition ORDER BY o.`relay_sequence` LIMIT :n FOR UPDATE SKIP LOCKED

-- debezium, MySql: claim_and_mark
WITH l AS (SELECT o.`relay_sequence` AS id FROM `public`.`outboxevent` o WHERE :condition
                         ORDER BY o.`relay_sequence` LIMIT :n FOR UPDATE SKIP LOCKED),
                  u AS (SELECT x.id, x.k, row_number() OVER () AS n
                          FROM (SELECT o.`relay_sequence` AS id, coalesce(CAST(o.`aggregateid` AS CHAR), CAST(o.`aggregatetype` AS CHAR)) AS k FROM `public`.`outboxevent` o WHERE :condition
                                 ORDER BY o.`relay_sequence` LIMIT :n) x),
                  passed AS (SELECT k, min(n) AS n FROM u
                              WHERE NOT EXISTS (SELECT 1 FROM l WHERE l.id = u.id) GROUP BY k),
                  c AS (SELECT u.id, u.n FROM u JOIN l ON l.id = u.id
                          LEFT JOIN passed ON passed.k IS NOT DISTINCT FROM u.k
                         WHERE passed.n IS NULL OR u.n < passed.n)
             UPDATE `public`.`outboxevent` o SET  FROM c
              WHERE o.`relay_sequence` = c.id AND :node IS NOT NULL AND :lease >= 0
             RETURNING (o.`relay_sequence` + 0), CAST(o.`id` AS CHAR), CAST(o.`aggregatetype` AS CHAR), CAST(o.`aggregateid` AS CHAR), CAST(o.`type` AS CHAR), o.`payload`, NULL, NULL, NULL, NULL, TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', o.`timestamp`), NULL, CAST(o.`tracingspancontext` AS CHAR), NULL, c.n

-- debezium, MySql: claim_order_column
14

-- debezium, MySql: at_micros
FROM_UNIXTIME(:micros / 1000000)

-- debezium, MySql: destination_is
CAST(CAST(o.`aggregatetype` AS CHAR) AS BINARY) = CAST(:destination AS BINARY)

-- debezium, MySql: delivered_between
(none)

-- debezium, MySql: delivered_before
(none)

-- debezium, MySql: dead_before
(EXISTS (SELECT 1 FROM `public`.`outboxevent_dead_letters` dl WHERE dl.id = o.`relay_sequence`)) AND (SELECT dl.dead_at FROM `public`.`outboxevent_dead_letters` dl WHERE dl.id = o.`relay_sequence`) < FROM_UNIXTIME(:before / 1000000)

-- debezium, MySql: release_unheld
(none)

-- debezium, MySql: count
SELECT CAST(count(*) AS SIGNED) FROM `public`.`outboxevent` o WHERE :condition

-- debezium, MySql: pick
SELECT CAST(o.`relay_sequence` AS CHAR) FROM `public`.`outboxevent` o WHERE :condition ORDER BY o.`relay_sequence` LIMIT :n

-- debezium, MySql: delete
DELETE FROM `public`.`outboxevent` WHERE `relay_sequence` IN (1, 2)

-- debezium, MySql: delete_dead_records
DELETE FROM `public`.`outboxevent_dead_letters` WHERE id IN (1, 2)

-- debezium, MySql: retry
(none)

-- debezium, MySql: dead_letter
INSERT IGNORE INTO `public`.`outboxevent_dead_letters` (id, attempts, last_error, dead_at)
                 SELECT o.`relay_sequence`, :attempts, :error, UTC_TIMESTAMP(6) FROM `public`.`outboxevent` o WHERE o.`relay_sequence` = :id AND :node IS NOT NULL

-- debezium, MySql: columns_query
SELECT CAST(column_name AS CHAR), CAST(data_type AS CHAR) FROM information_schema.columns WHERE table_schema = :p1 AND table_name = :p2

-- debezium, MySql: column_length_query
SELECT CAST(character_maximum_length AS SIGNED), CAST(character_octet_length AS SIGNED) FROM information_schema.columns WHERE table_schema = :p3 AND table_name = :p4 AND column_name = :p5

-- debezium, MySql: unique_column_query
SELECT CAST(COUNT(*) AS SIGNED) FROM (SELECT index_name FROM information_schema.statistics WHERE table_schema = :p6 AND table_name = :p7 AND non_unique = 0 GROUP BY index_name HAVING COUNT(*) = 1 AND MAX(column_name) = :p8 AND MAX(sub_part) IS NULL) u

-- debezium, MySql: insert
INSERT INTO `public`.`outboxevent` (`relay_sequence`, `aggregatetype`, `id`) VALUES (?, ?, gen_random_uuid())

-- debezium, MySql: not_in_ids
o.`relay_sequence` NOT IN (1, 2)

-- debezium, MySql: not_in_texts
CAST(coalesce(CAST(o.`aggregateid` AS CHAR), CAST(o.`aggregatetype` AS CHAR)) AS BINARY) NOT IN (CAST(:p9 AS BINARY), CAST(:p10 AS BINARY))

-- mysql_outbox_events, Postgres: table
"outbox_events"

-- mysql_outbox_events, Postgres: dead_table
"outbox_events_dead_letters"

-- mysql_outbox_events, Postgres: now
now()

-- mysql_outbox_events, Postgres: id_expr
(o."id")::int8

-- mysql_outbox_events, Postgres: key_expr
(o."type")::text

-- mysql_outbox_events, Postgres: select_list
(o."id")::int8, NULL::text, (o."type")::text, NULL::text, (o."type")::text, (o."message")::text, NULL::text, NULL::text, NULL::int8, NULL::int8, CASE WHEN isfinite(o."createdAt") THEN (extract(epoch from o."createdAt") * 1000000)::int8 WHEN o."createdAt" > 'epoch' THEN 9223372036854775807 ELSE -9223372036854775807 - 1 END, NULL::int8, NULL::text, NULL::text

-- mysql_outbox_events, Postgres: pending
o."isConsumed" = 0 AND NOT EXISTS (SELECT 1 FROM "outbox_events_dead_letters" dl WHERE dl.id = o."id")

-- mysql_outbox_events, Postgres: dead
EXISTS (SELECT 1 FROM "outbox_events_dead_letters" dl WHERE dl.id = o."id")

-- mysql_outbox_events, Postgres: delivered
o."isConsumed" = 1

-- mysql_outbox_events, Postgres: claimable
o."isConsumed" = 0 AND NOT EXISTS (SELECT 1 FROM "outbox_events_dead_letters" dl WHERE dl.id = o."id")

-- mysql_outbox_events, Postgres: order_by
o."createdAt", o."id"

-- mysql_outbox_events, Postgres: claim_set


-- mysql_outbox_events, Postgres: fence
$node IS NOT NULL

-- mysql_outbox_events, Postgres: ack
UPDATE "outbox_events" o SET "isConsumed" = 1, "updatedAt" = now() WHERE o."id" = ANY($ids) AND $node IS NOT NULL

-- mysql_outbox_events, Postgres: retry_set


-- mysql_outbox_events, Postgres: dead_set


-- mysql_outbox_events, Postgres: release
(none)

-- mysql_outbox_events, Postgres: release unheld
(none)

-- mysql_outbox_events, Postgres: extend
(none)

-- mysql_outbox_events, Postgres: reap to pending
(none)

-- mysql_outbox_events, Postgres: reap to dead
(none)

-- mysql_outbox_events, Postgres: stats
SELECT (coalesce(sum(CASE WHEN o."isConsumed" = 0 AND NOT EXISTS (SELECT 1 FROM "outbox_events_dead_letters" dl WHERE dl.id = o."id") THEN 1 ELSE 0 END), 0))::int8, (coalesce(sum(CASE WHEN false THEN 1 ELSE 0 END), 0))::int8, (coalesce(sum(CASE WHEN EXISTS (SELECT 1 FROM "outbox_events_dead_letters" dl WHERE dl.id = o."id") THEN 1 ELSE 0 END), 0))::int8, (extract(epoch from now() - min(CASE WHEN o."isConsumed" = 0 AND NOT EXISTS (SELECT 1 FROM "outbox_events_dead_letters" dl WHERE dl.id = o."id") AND isfinite(o."createdAt") THEN o."createdAt" END)) * 1000)::int8 FROM "outbox_events" o WHERE (o."isConsumed" = 0 AND NOT EXISTS (SELECT 1 FROM "outbox_events_dead_letters" dl WHERE dl.id = o."id")) OR (EXISTS (SELECT 1 FROM "outbox_events_dead_letters" dl WHERE dl.id = o."id"))

-- mysql_outbox_events, Postgres: stats by destination
SELECT (o."type")::text, (coalesce(sum(CASE WHEN o."isConsumed" = 0 AND NOT EXISTS (SELECT 1 FROM "outbox_events_dead_letters" dl WHERE dl.id = o."id") THEN 1 ELSE 0 END), 0))::int8, (coalesce(sum(CASE WHEN false THEN 1 ELSE 0 END), 0))::int8, (coalesce(sum(CASE WHEN EXISTS (SELECT 1 FROM "outbox_events_dead_letters" dl WHERE dl.id = o."id") THEN 1 ELSE 0 END), 0))::int8, (extract(epoch from now() - min(CASE WHEN o."isConsumed" = 0 AND NOT EXISTS (SELECT 1 FROM "outbox_events_dead_letters" dl WHERE dl.id = o."id") AND isfinite(o."createdAt") THEN o."createdAt" END)) * 1000)::int8 FROM "outbox_events" o WHERE (o."isConsumed" = 0 AND NOT EXISTS (SELECT 1 FROM "outbox_events_dead_letters" dl WHERE dl.id = o."id")) OR (EXISTS (SELECT 1 FROM "outbox_events_dead_letters" dl WHERE dl.id = o."id")) GROUP BY (o."type")::text ORDER BY (o."type")::text

-- mysql_outbox_events, Postgres: dead_list
SELECT (o."id")::text, NULL::text, (o."type")::text, (o."type")::text, ((SELECT dl.attempts FROM "outbox_events_dead_letters" dl WHERE dl.id = o."id"))::int8, ((SELECT dl.last_error FROM "outbox_events_dead_letters" dl WHERE dl.id = o."id"))::text, CASE WHEN isfinite((SELECT dl.dead_at FROM "outbox_events_dead_letters" dl WHERE dl.id = o."id")) THEN (extract(epoch from (SELECT dl.dead_at FROM "outbox_events_dead_letters" dl WHERE dl.id = o."id")) * 1000000)::int8 WHEN (SELECT dl.dead_at FROM "outbox_events_dead_letters" dl WHERE dl.id = o."id") > 'epoch' THEN 9223372036854775807 ELSE -9223372036854775807 - 1 END FROM "outbox_events" o WHERE EXISTS (SELECT 1 FROM "outbox_events_dead_letters" dl WHERE dl.id = o."id") AND :filter ORDER BY o."id" LIMIT $n

-- mysql_outbox_events, Postgres: event
SELECT (o."id")::int8, NULL::text, (o."type")::text, NULL::text, (o."type")::text, (o."message")::text, NULL::text, NULL::text, NULL::int8, NULL::int8, CASE WHEN isfinite(o."createdAt") THEN (extract(epoch from o."createdAt") * 1000000)::int8 WHEN o."createdAt" > 'epoch' THEN 9223372036854775807 ELSE -9223372036854775807 - 1 END, NULL::int8, NULL::text, NULL::text, ((CASE WHEN EXISTS (SELECT 1 FROM "outbox_events_dead_letters" dl WHERE dl.id = o."id") THEN 2 WHEN o."isConsumed" = 1 THEN 1 ELSE 0 END))::int8, ((SELECT dl.attempts FROM "outbox_events_dead_letters" dl WHERE dl.id = o."id"))::int8, ((SELECT dl.last_error FROM "outbox_events_dead_letters" dl WHERE dl.id = o."id"))::text, CASE WHEN isfinite((SELECT dl.dead_at FROM "outbox_events_dead_letters" dl WHERE dl.id = o."id")) THEN (extract(epoch from (SELECT dl.dead_at FROM "outbox_events_dead_letters" dl WHERE dl.id = o."id")) * 1000000)::int8 WHEN (SELECT dl.dead_at FROM "outbox_events_dead_letters" dl WHERE dl.id = o."id") > 'epoch' THEN 9223372036854775807 ELSE -9223372036854775807 - 1 END FROM "outbox_events" o WHERE :condition

-- mysql_outbox_events, Postgres: dead_retry
(none)

-- mysql_outbox_events, Postgres: destination_text
(o."type")::text

-- mysql_outbox_events, Postgres: delivered_time
o."updatedAt"

-- mysql_outbox_events, Postgres: dead_time
(SELECT dl.dead_at FROM "outbox_events_dead_letters" dl WHERE dl.id = o."id")

-- mysql_outbox_events, Postgres: created_at
o."createdAt"

-- mysql_outbox_events, Postgres: replay_set
"isConsumed" = 0, "updatedAt" = now()

-- mysql_outbox_events, Postgres: dead_table_ddl
-- Dead events of a layout that cannot mark them; the outbox row itself is left as it is.
CREATE TABLE IF NOT EXISTS "outbox_events_dead_letters" (
    id bigint PRIMARY KEY,
    attempts integer NOT NULL,
    last_error text NOT NULL,
    dead_at timestamptz NOT NULL DEFAULT now()
);


-- mysql_outbox_events, Postgres: ddl
CREATE TABLE IF NOT EXISTS `outbox_events` (
`id` bigint unsigned NOT NULL AUTO_INCREMENT,
`type` tinyint unsigned NOT NULL,
`message` mediumtext NOT NULL,
`isConsumed` tinyint(1) NOT NULL DEFAULT '0',
`createdAt` datetime NOT NULL,
`updatedAt` datetime NOT NULL,
PRIMARY KEY (`id`),
KEY `outbox_events_is_consumed_created_at` (`isConsumed`,`createdAt`),
KEY `createdAt` (`createdAt`)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4;
-- Dead events of a layout that cannot mark them; the outbox row itself is left as it is.
CREATE TABLE IF NOT EXISTS "outbox_events_dead_letters" (
    id bigint PRIMARY KEY,
    attempts integer NOT NULL,
    last_error text NOT NULL,
    dead_at timestamptz NOT NULL DEFAULT now()
);


-- mysql_outbox_events, Postgres: grants
GRANT SELECT, UPDATE ON "outbox_events" TO "relay";
GRANT SELECT, INSERT, DELETE ON "outbox_events_dead_letters" TO "relay";
-- Operators (`dead purge`, `prune`) also need DELETE on "outbox_events".


-- mysql_outbox_events, Postgres: claim_select
SELECT (o."id")::int8, NULL::text, (o."type")::text, NULL::text, (o."type")::text, (o."message")::text, NULL::text, NULL::text, NULL::int8, NULL::int8, CASE WHEN isfinite(o."createdAt") THEN (extract(epoch from o."createdAt") * 1000000)::int8 WHEN o."createdAt" > 'epoch' THEN 9223372036854775807 ELSE -9223372036854775807 - 1 END, NULL::int8, NULL::text, NULL::text FROM "outbox_events" o WHERE :condition ORDER BY o."createdAt", o."id" LIMIT $n

-- mysql_outbox_events, Postgres: claim_select locking
SELECT (o."id")::int8, NULL::text, (o."type")::text, NULL::text, (o."type")::text, (o."message")::text, NULL::text, NULL::text, NULL::int8, NULL::int8, CASE WHEN isfinite(o."createdAt") THEN (extract(epoch from o."createdAt") * 1000000)::int8 WHEN o."createdAt" > 'epoch' THEN 9223372036854775807 ELSE -9223372036854775807 - 1 END, NULL::int8, NULL::text, NULL::text FROM "outbox_events" o WHERE :condition ORDER BY o."createdAt", o."id" LIMIT $n FOR UPDATE SKIP LOCKED

-- mysql_outbox_events, Postgres: claim_and_mark
WITH l AS (SELECT o."id" AS id FROM "outbox_events" o WHERE :condition
                         ORDER BY o."createdAt", o."id" LIMIT $n FOR UPDATE SKIP LOCKED),
                  u AS (SELECT x.id, x.k, row_number() OVER () AS n
                          FROM (SELECT o."id" AS id, (o."type")::text AS k FROM "outbox_events" o WHERE :condition
                                 ORDER BY o."createdAt", o."id" LIMIT $n) x),
                  passed AS (SELECT k, min(n) AS n FROM u
                              WHERE NOT EXISTS (SELECT 1 FROM l WHERE l.id = u.id) GROUP BY k),
                  c AS (SELECT u.id, u.n FROM u JOIN l ON l.id = u.id
                          LEFT JOIN passed ON passed.k IS NOT DISTINCT FROM u.k
                         WHERE passed.n IS NULL OR u.n < passed.n)
             UPDATE "outbox_events" o SET  FROM c
              WHERE o."id" = c.id AND $node IS NOT NULL AND $lease >= 0
             RETURNING (o."id")::int8, NULL::text, (o."type")::text, NULL::text, (o."type")::text, (o."message")::text, NULL::text, NULL::text, NULL::int8, NULL::int8, CASE WHEN isfinite(o."createdAt") THEN (extract(epoch from o."createdAt") * 1000000)::int8 WHEN o."createdAt" > 'epoch' THEN 9223372036854775807 ELSE -9223372036854775807 - 1 END, NULL::int8, NULL::text, NULL::text, c.n

-- mysql_outbox_events, Postgres: claim_order_column
14

-- mysql_outbox_events, Postgres: at_micros
to_timestamp(:micros::float8 / 1e6)

-- mysql_outbox_events, Postgres: destination_is
(o."type")::text = :destination

-- mysql_outbox_events, Postgres: delivered_between
(o."isConsumed" = 1) AND o."createdAt" >= to_timestamp(:since::float8 / 1e6) AND o."createdAt" < to_timestamp(:until::float8 / 1e6)

-- mysql_outbox_events, Postgres: delivered_before
(o."isConsumed" = 1) AND o."updatedAt" < to_timestamp(:before::float8 / 1e6)

-- mysql_outbox_events, Postgres: dead_before
(EXISTS (SELECT 1 FROM "outbox_events_dead_letters" dl WHERE dl.id = o."id")) AND (SELECT dl.dead_at FROM "outbox_events_dead_letters" dl WHERE dl.id = o."id") < to_timestamp(:before::float8 / 1e6)

-- mysql_outbox_events, Postgres: release_unheld
(none)

-- mysql_outbox_events, Postgres: count
SELECT (count(*))::int8 FROM "outbox_events" o WHERE :condition

-- mysql_outbox_events, Postgres: pick
SELECT (o."id")::text FROM "outbox_events" o WHERE :condition ORDER BY o."id" LIMIT $n

-- mysql_outbox_events, Postgres: delete
DELETE FROM "outbox_events" WHERE "id" = ANY($ids)

-- mysql_outbox_events, Postgres: delete_dead_records
DELETE FROM "outbox_events_dead_letters" WHERE id = ANY($ids)

-- mysql_outbox_events, Postgres: retry
(none)

-- mysql_outbox_events, Postgres: dead_letter
INSERT INTO "outbox_events_dead_letters" (id, attempts, last_error)
                 SELECT o."id", :attempts, :error FROM "outbox_events" o WHERE o."id" = :id AND $node IS NOT NULL
                 ON CONFLICT (id) DO NOTHING

-- mysql_outbox_events, Postgres: columns_query
SELECT (column_name)::text, (data_type)::text FROM information_schema.columns WHERE table_schema = $1::text AND table_name = $2::text

-- mysql_outbox_events, Postgres: column_length_query
SELECT (character_maximum_length)::int8, (character_octet_length)::int8 FROM information_schema.columns WHERE table_schema = $3::text AND table_name = $4::text AND column_name = $5::text

-- mysql_outbox_events, Postgres: unique_column_query
SELECT count(*)::int8 FROM pg_index i JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0] WHERE i.indrelid = to_regclass($6::text) AND i.indisunique AND i.indnkeyatts = 1 AND i.indpred IS NULL AND a.attname = $7::text

-- mysql_outbox_events, Postgres: insert
INSERT INTO "outbox_events" ("id", "type", "createdAt", "updatedAt") VALUES ($1, $2, UTC_TIMESTAMP(), UTC_TIMESTAMP()) RETURNING "id"

-- mysql_outbox_events, Postgres: not_in_ids
o."id" NOT IN (SELECT unnest($8::int8[]))

-- mysql_outbox_events, Postgres: not_in_texts
(o."type")::text NOT IN (SELECT unnest($9::text[]))

-- mysql_outbox_events, MySql: table
`outbox_events`

-- mysql_outbox_events, MySql: dead_table
`outbox_events_dead_letters`

-- mysql_outbox_events, MySql: now
UTC_TIMESTAMP(6)

-- mysql_outbox_events, MySql: id_expr
(o.`id` + 0)

-- mysql_outbox_events, MySql: key_expr
CAST(o.`type` AS CHAR)

-- mysql_outbox_events, MySql: select_list
(o.`id` + 0), NULL, CAST(o.`type` AS CHAR), NULL, CAST(o.`type` AS CHAR), o.`message`, NULL, NULL, NULL, NULL, TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', o.`createdAt`), NULL, NULL, NULL

-- mysql_outbox_events, MySql: pending
o.`isConsumed` = 0 AND NOT EXISTS (SELECT 1 FROM `outbox_events_dead_letters` dl WHERE dl.id = o.`id`)

-- mysql_outbox_events, MySql: dead
EXISTS (SELECT 1 FROM `outbox_events_dead_letters` dl WHERE dl.id = o.`id`)

-- mysql_outbox_events, MySql: delivered
o.`isConsumed` = 1

-- mysql_outbox_events, MySql: claimable
o.`isConsumed` = 0 AND NOT EXISTS (SELECT 1 FROM `outbox_events_dead_letters` dl WHERE dl.id = o.`id`)

-- mysql_outbox_events, MySql: order_by
o.`createdAt`, o.`id`

-- mysql_outbox_events, MySql: claim_set


-- mysql_outbox_events, MySql: fence
:node IS NOT NULL

-- mysql_outbox_events, MySql: ack
UPDATE `outbox_events` o SET o.`isConsumed` = 1, o.`updatedAt` = UTC_TIMESTAMP(6) WHERE o.`id` IN (1, 2) AND :node IS NOT NULL ORDER BY `id` LIMIT 2

-- mysql_outbox_events, MySql: retry_set


-- mysql_outbox_events, MySql: dead_set


-- mysql_outbox_events, MySql: release
(none)

-- mysql_outbox_events, MySql: release unheld
(none)

-- mysql_outbox_events, MySql: extend
(none)

-- mysql_outbox_events, MySql: reap to pending
(none)

-- mysql_outbox_events, MySql: reap to dead
(none)

-- mysql_outbox_events, MySql: stats
SELECT CAST(coalesce(sum(CASE WHEN o.`isConsumed` = 0 AND NOT EXISTS (SELECT 1 FROM `outbox_events_dead_letters` dl WHERE dl.id = o.`id`) THEN 1 ELSE 0 END), 0) AS SIGNED), CAST(coalesce(sum(CASE WHEN 1 = 0 THEN 1 ELSE 0 END), 0) AS SIGNED), CAST(coalesce(sum(CASE WHEN EXISTS (SELECT 1 FROM `outbox_events_dead_letters` dl WHERE dl.id = o.`id`) THEN 1 ELSE 0 END), 0) AS SIGNED), CAST(TIMESTAMPDIFF(MICROSECOND, min(CASE WHEN o.`isConsumed` = 0 AND NOT EXISTS (SELECT 1 FROM `outbox_events_dead_letters` dl WHERE dl.id = o.`id`) THEN o.`createdAt` END), UTC_TIMESTAMP(6)) / 1000 AS SIGNED) FROM `outbox_events` o WHERE (o.`isConsumed` = 0 AND NOT EXISTS (SELECT 1 FROM `outbox_events_dead_letters` dl WHERE dl.id = o.`id`)) OR (EXISTS (SELECT 1 FROM `outbox_events_dead_letters` dl WHERE dl.id = o.`id`))

-- mysql_outbox_events, MySql: stats by destination
SELECT CAST(o.`type` AS CHAR), CAST(coalesce(sum(CASE WHEN o.`isConsumed` = 0 AND NOT EXISTS (SELECT 1 FROM `outbox_events_dead_letters` dl WHERE dl.id = o.`id`) THEN 1 ELSE 0 END), 0) AS SIGNED), CAST(coalesce(sum(CASE WHEN 1 = 0 THEN 1 ELSE 0 END), 0) AS SIGNED), CAST(coalesce(sum(CASE WHEN EXISTS (SELECT 1 FROM `outbox_events_dead_letters` dl WHERE dl.id = o.`id`) THEN 1 ELSE 0 END), 0) AS SIGNED), CAST(TIMESTAMPDIFF(MICROSECOND, min(CASE WHEN o.`isConsumed` = 0 AND NOT EXISTS (SELECT 1 FROM `outbox_events_dead_letters` dl WHERE dl.id = o.`id`) THEN o.`createdAt` END), UTC_TIMESTAMP(6)) / 1000 AS SIGNED) FROM `outbox_events` o WHERE (o.`isConsumed` = 0 AND NOT EXISTS (SELECT 1 FROM `outbox_events_dead_letters` dl WHERE dl.id = o.`id`)) OR (EXISTS (SELECT 1 FROM `outbox_events_dead_letters` dl WHERE dl.id = o.`id`)) GROUP BY CAST(o.`type` AS CHAR) ORDER BY CAST(o.`type` AS CHAR)

-- mysql_outbox_events, MySql: dead_list
SELECT CAST(o.`id` AS CHAR), NULL, CAST(o.`type` AS CHAR), CAST(o.`type` AS CHAR), CAST((SELECT dl.attempts FROM `outbox_events_dead_letters` dl WHERE dl.id = o.`id`) AS SIGNED), CAST((SELECT dl.last_error FROM `outbox_events_dead_letters` dl WHERE dl.id = o.`id`) AS CHAR), TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', (SELECT dl.dead_at FROM `outbox_events_dead_letters` dl WHERE dl.id = o.`id`)) FROM `outbox_events` o WHERE EXISTS (SELECT 1 FROM `outbox_events_dead_letters` dl WHERE dl.id = o.`id`) AND :filter ORDER BY o.`id` LIMIT :n

-- mysql_outbox_events, MySql: event
SELECT (o.`id` + 0), NULL, CAST(o.`type` AS CHAR), NULL, CAST(o.`type` AS CHAR), o.`message`, NULL, NULL, NULL, NULL, TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', o.`createdAt`), NULL, NULL, NULL, CAST((CASE WHEN EXISTS (SELECT 1 FROM `outbox_events_dead_letters` dl WHERE dl.id = o.`id`) THEN 2 WHEN o.`isConsumed` = 1 THEN 1 ELSE 0 END) AS SIGNED), CAST((SELECT dl.attempts FROM `outbox_events_dead_letters` dl WHERE dl.id = o.`id`) AS SIGNED), CAST((SELECT dl.last_error FROM `outbox_events_dead_letters` dl WHERE dl.id = o.`id`) AS CHAR), TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', (SELECT dl.dead_at FROM `outbox_events_dead_letters` dl WHERE dl.id = o.`id`)) FROM `outbox_events` o WHERE :condition

-- mysql_outbox_events, MySql: dead_retry
(none)

-- mysql_outbox_events, MySql: destination_text
CAST(o.`type` AS CHAR)

-- mysql_outbox_events, MySql: delivered_time
o.`updatedAt`

-- mysql_outbox_events, MySql: dead_time
(SELECT dl.dead_at FROM `outbox_events_dead_letters` dl WHERE dl.id = o.`id`)

-- mysql_outbox_events, MySql: created_at
o.`createdAt`

-- mysql_outbox_events, MySql: replay_set
`isConsumed` = 0, `updatedAt` = UTC_TIMESTAMP(6)

-- mysql_outbox_events, MySql: dead_table_ddl
-- Dead events of a layout that cannot mark them; the outbox row itself is left as it is.
CREATE TABLE IF NOT EXISTS `outbox_events_dead_letters` (
    id bigint unsigned PRIMARY KEY,
    attempts integer NOT NULL,
    last_error text NOT NULL,
    dead_at datetime(6) NOT NULL
);


-- mysql_outbox_events, MySql: ddl
CREATE TABLE IF NOT EXISTS `outbox_events` (
`id` bigint unsigned NOT NULL AUTO_INCREMENT,
`type` tinyint unsigned NOT NULL,
`message` mediumtext NOT NULL,
`isConsumed` tinyint(1) NOT NULL DEFAULT '0',
`createdAt` datetime NOT NULL,
`updatedAt` datetime NOT NULL,
PRIMARY KEY (`id`),
KEY `outbox_events_is_consumed_created_at` (`isConsumed`,`createdAt`),
KEY `createdAt` (`createdAt`)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4;
-- Dead events of a layout that cannot mark them; the outbox row itself is left as it is.
CREATE TABLE IF NOT EXISTS `outbox_events_dead_letters` (
    id bigint unsigned PRIMARY KEY,
    attempts integer NOT NULL,
    last_error text NOT NULL,
    dead_at datetime(6) NOT NULL
);


-- mysql_outbox_events, MySql: grants
GRANT SELECT, UPDATE ON `outbox_events` TO 'relay'@'%';
GRANT SELECT, INSERT, DELETE ON `outbox_events_dead_letters` TO 'relay'@'%';
-- Operators (`dead purge`, `prune`) also need DELETE on `outbox_events`.


-- mysql_outbox_events, MySql: claim_select
SELECT (o.`id` + 0), NULL, CAST(o.`type` AS CHAR), NULL, CAST(o.`type` AS CHAR), o.`message`, NULL, NULL, NULL, NULL, TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', o.`createdAt`), NULL, NULL, NULL FROM `outbox_events` o WHERE :condition ORDER BY o.`createdAt`, o.`id` LIMIT :n

-- mysql_outbox_events, MySql: claim_select locking
SELECT (o.`id` + 0), NULL, CAST(o.`type` AS CHAR), NULL, CAST(o.`type` AS CHAR), o.`message`, NULL, NULL, NULL, NULL, TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', o.`createdAt`), NULL, NULL, NULL FROM `outbox_events` o WHERE :condition ORDER BY o.`createdAt`, o.`id` LIMIT :n FOR UPDATE SKIP LOCKED

-- mysql_outbox_events, MySql: claim_and_mark
WITH l AS (SELECT o.`id` AS id FROM `outbox_events` o WHERE :condition
                         ORDER BY o.`createdAt`, o.`id` LIMIT :n FOR UPDATE SKIP LOCKED),
                  u AS (SELECT x.id, x.k, row_number() OVER () AS n
                          FROM (SELECT o.`id` AS id, CAST(o.`type` AS CHAR) AS k FROM `outbox_events` o WHERE :condition
                                 ORDER BY o.`createdAt`, o.`id` LIMIT :n) x),
                  passed AS (SELECT k, min(n) AS n FROM u
                              WHERE NOT EXISTS (SELECT 1 FROM l WHERE l.id = u.id) GROUP BY k),
                  c AS (SELECT u.id, u.n FROM u JOIN l ON l.id = u.id
                          LEFT JOIN passed ON passed.k IS NOT DISTINCT FROM u.k
                         WHERE passed.n IS NULL OR u.n < passed.n)
             UPDATE `outbox_events` o SET  FROM c
              WHERE o.`id` = c.id AND :node IS NOT NULL AND :lease >= 0
             RETURNING (o.`id` + 0), NULL, CAST(o.`type` AS CHAR), NULL, CAST(o.`type` AS CHAR), o.`message`, NULL, NULL, NULL, NULL, TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', o.`createdAt`), NULL, NULL, NULL, c.n

-- mysql_outbox_events, MySql: claim_order_column
14

-- mysql_outbox_events, MySql: at_micros
FROM_UNIXTIME(:micros / 1000000)

-- mysql_outbox_events, MySql: destination_is
CAST(CAST(o.`type` AS CHAR) AS BINARY) = CAST(:destination AS BINARY)

-- mysql_outbox_events, MySql: delivered_between
(o.`isConsumed` = 1) AND o.`createdAt` >= FROM_UNIXTIME(:since / 1000000) AND o.`createdAt` < FROM_UNIXTIME(:until / 1000000)

-- mysql_outbox_events, MySql: delivered_before
(o.`isConsumed` = 1) AND o.`updatedAt` < FROM_UNIXTIME(:before / 1000000)

-- mysql_outbox_events, MySql: dead_before
(EXISTS (SELECT 1 FROM `outbox_events_dead_letters` dl WHERE dl.id = o.`id`)) AND (SELECT dl.dead_at FROM `outbox_events_dead_letters` dl WHERE dl.id = o.`id`) < FROM_UNIXTIME(:before / 1000000)

-- mysql_outbox_events, MySql: release_unheld
(none)

-- mysql_outbox_events, MySql: count
SELECT CAST(count(*) AS SIGNED) FROM `outbox_events` o WHERE :condition

-- mysql_outbox_events, MySql: pick
SELECT CAST(o.`id` AS CHAR) FROM `outbox_events` o WHERE :condition ORDER BY o.`id` LIMIT :n

-- mysql_outbox_events, MySql: delete
DELETE FROM `outbox_events` WHERE `id` IN (1, 2)

-- mysql_outbox_events, MySql: delete_dead_records
DELETE FROM `outbox_events_dead_letters` WHERE id IN (1, 2)

-- mysql_outbox_events, MySql: retry
(none)

-- mysql_outbox_events, MySql: dead_letter
INSERT IGNORE INTO `outbox_events_dead_letters` (id, attempts, last_error, dead_at)
                 SELECT o.`id`, :attempts, :error, UTC_TIMESTAMP(6) FROM `outbox_events` o WHERE o.`id` = :id AND :node IS NOT NULL

-- mysql_outbox_events, MySql: columns_query
SELECT CAST(column_name AS CHAR), CAST(data_type AS CHAR) FROM information_schema.columns WHERE table_schema = DATABASE() AND table_name = :p1

-- mysql_outbox_events, MySql: column_length_query
SELECT CAST(character_maximum_length AS SIGNED), CAST(character_octet_length AS SIGNED) FROM information_schema.columns WHERE table_schema = DATABASE() AND table_name = :p2 AND column_name = :p3

-- mysql_outbox_events, MySql: unique_column_query
SELECT CAST(COUNT(*) AS SIGNED) FROM (SELECT index_name FROM information_schema.statistics WHERE table_schema = DATABASE() AND table_name = :p4 AND non_unique = 0 GROUP BY index_name HAVING COUNT(*) = 1 AND MAX(column_name) = :p5 AND MAX(sub_part) IS NULL) u

-- mysql_outbox_events, MySql: insert
INSERT INTO `outbox_events` (`id`, `type`, `createdAt`, `updatedAt`) VALUES (?, ?, UTC_TIMESTAMP(), UTC_TIMESTAMP())

-- mysql_outbox_events, MySql: not_in_ids
o.`id` NOT IN (1, 2)

-- mysql_outbox_events, MySql: not_in_texts
CAST(CAST(o.`type` AS CHAR) AS BINARY) NOT IN (CAST(:p6 AS BINARY), CAST(:p7 AS BINARY))

-- native_mysql, Postgres: table
"app"."outbox"

-- native_mysql, Postgres: dead_table
"app"."outbox_dead_letters"

-- native_mysql, Postgres: now
now()

-- native_mysql, Postgres: id_expr
(o."sequence_id")::int8

-- native_mysql, Postgres: key_expr
coalesce((o."partition_key")::text, (o."destination")::text)

-- native_mysql, Postgres: select_list
(o."sequence_id")::int8, (o."event_id")::text, (o."destination")::text, (o."partition_key")::text, (o."event_type")::text, (o."payload")::text, (o."headers")::text, (o."mutation_id")::text, (CASE WHEN o."rejected" THEN 1 ELSE 0 END)::int8, (o."attempts")::int8, CASE WHEN isfinite(o."created_at") THEN (extract(epoch from o."created_at") * 1000000)::int8 WHEN o."created_at" > 'epoch' THEN 9223372036854775807 ELSE -9223372036854775807 - 1 END, NULL::int8, NULL::text, NULL::text

-- native_mysql, Postgres: pending
o."delivered_at" IS NULL AND o."dead_at" IS NULL

-- native_mysql, Postgres: dead
o."dead_at" IS NOT NULL

-- native_mysql, Postgres: delivered
o."delivered_at" IS NOT NULL

-- native_mysql, Postgres: claimable
o."delivered_at" IS NULL AND o."dead_at" IS NULL AND (o."locked_until" IS NULL OR o."locked_until" < now()) AND o."available_at" <= now()

-- native_mysql, Postgres: order_by
o."sequence_id"

-- native_mysql, Postgres: claim_set
"locked_by" = $node, "locked_until" = now() + $lease::int8 * interval '1 millisecond'

-- native_mysql, Postgres: fence
o."locked_by" = $node

-- native_mysql, Postgres: ack
DELETE FROM "app"."outbox" o WHERE o."sequence_id" = ANY($ids) AND o."locked_by" = $node

-- native_mysql, Postgres: retry_set
"locked_by" = NULL, "locked_until" = NULL, "attempts" = :attempts, "last_error" = :error, "available_at" = now() + :delay::int8 * interval '1 millisecond'

-- native_mysql, Postgres: dead_set
"dead_at" = now(), "attempts" = :attempts, "last_error" = :error, "locked_by" = NULL, "locked_until" = NULL

-- native_mysql, Postgres: release
UPDATE "app"."outbox" o SET "locked_by" = NULL, "locked_until" = NULL WHERE o."sequence_id" = ANY($ids) AND o."locked_by" = $node

-- native_mysql, Postgres: release unheld
UPDATE "app"."outbox" o SET "locked_by" = NULL, "locked_until" = NULL WHERE o."locked_by" IS NOT NULL AND o."locked_by" = $node AND :not_held

-- native_mysql, Postgres: extend
UPDATE "app"."outbox" o SET "locked_until" = now() + $lease::int8 * interval '1 millisecond' WHERE o."sequence_id" = ANY($ids) AND o."locked_by" = $node AND $lease >= 0

-- native_mysql, Postgres: reap to pending
UPDATE "app"."outbox" o SET "locked_by" = NULL, "locked_until" = NULL WHERE o."locked_by" IS NOT NULL AND (:all OR o."locked_until" < now()) AND :max IS NOT NULL AND $lease >= 0

-- native_mysql, Postgres: reap to dead
(none)

-- native_mysql, Postgres: stats
SELECT (coalesce(sum(CASE WHEN o."delivered_at" IS NULL AND o."dead_at" IS NULL THEN 1 ELSE 0 END), 0))::int8, (coalesce(sum(CASE WHEN (o."delivered_at" IS NULL AND o."dead_at" IS NULL) AND o."attempts" > 0 THEN 1 ELSE 0 END), 0))::int8, (coalesce(sum(CASE WHEN o."dead_at" IS NOT NULL THEN 1 ELSE 0 END), 0))::int8, (extract(epoch from now() - min(CASE WHEN o."delivered_at" IS NULL AND o."dead_at" IS NULL AND isfinite(o."created_at") THEN CASE WHEN o."attempts" > 0 THEN o."created_at" WHEN o."available_at" IS NULL THEN o."created_at" WHEN o."available_at" <= now() THEN (CASE WHEN o."available_at" > o."created_at" THEN o."available_at" ELSE o."created_at" END) END END)) * 1000)::int8 FROM "app"."outbox" o WHERE (o."delivered_at" IS NULL AND o."dead_at" IS NULL) OR (o."dead_at" IS NOT NULL)

-- native_mysql, Postgres: stats by destination
SELECT (o."destination")::text, (coalesce(sum(CASE WHEN o."delivered_at" IS NULL AND o."dead_at" IS NULL THEN 1 ELSE 0 END), 0))::int8, (coalesce(sum(CASE WHEN (o."delivered_at" IS NULL AND o."dead_at" IS NULL) AND o."attempts" > 0 THEN 1 ELSE 0 END), 0))::int8, (coalesce(sum(CASE WHEN o."dead_at" IS NOT NULL THEN 1 ELSE 0 END), 0))::int8, (extract(epoch from now() - min(CASE WHEN o."delivered_at" IS NULL AND o."dead_at" IS NULL AND isfinite(o."created_at") THEN CASE WHEN o."attempts" > 0 THEN o."created_at" WHEN o."available_at" IS NULL THEN o."created_at" WHEN o."available_at" <= now() THEN (CASE WHEN o."available_at" > o."created_at" THEN o."available_at" ELSE o."created_at" END) END END)) * 1000)::int8 FROM "app"."outbox" o WHERE (o."delivered_at" IS NULL AND o."dead_at" IS NULL) OR (o."dead_at" IS NOT NULL) GROUP BY (o."destination")::text ORDER BY (o."destination")::text

-- native_mysql, Postgres: dead_list
SELECT (o."sequence_id")::text, (o."event_id")::text, (o."destination")::text, (o."event_type")::text, (o."attempts")::int8, (o."last_error")::text, CASE WHEN isfinite(o."dead_at") THEN (extract(epoch from o."dead_at") * 1000000)::int8 WHEN o."dead_at" > 'epoch' THEN 9223372036854775807 ELSE -9223372036854775807 - 1 END FROM "app"."outbox" o WHERE o."dead_at" IS NOT NULL AND :filter ORDER BY o."sequence_id" LIMIT $n

-- native_mysql, Postgres: event
SELECT (o."sequence_id")::int8, (o."event_id")::text, (o."destination")::text, (o."partition_key")::text, (o."event_type")::text, (o."payload")::text, (o."headers")::text, (o."mutation_id")::text, (CASE WHEN o."rejected" THEN 1 ELSE 0 END)::int8, (o."attempts")::int8, CASE WHEN isfinite(o."created_at") THEN (extract(epoch from o."created_at") * 1000000)::int8 WHEN o."created_at" > 'epoch' THEN 9223372036854775807 ELSE -9223372036854775807 - 1 END, NULL::int8, NULL::text, NULL::text, ((CASE WHEN o."dead_at" IS NOT NULL THEN 2 WHEN o."delivered_at" IS NOT NULL THEN 1 ELSE 0 END))::int8, (o."attempts")::int8, (o."last_error")::text, CASE WHEN isfinite(o."dead_at") THEN (extract(epoch from o."dead_at") * 1000000)::int8 WHEN o."dead_at" > 'epoch' THEN 9223372036854775807 ELSE -9223372036854775807 - 1 END FROM "app"."outbox" o WHERE :condition

-- native_mysql, Postgres: dead_retry
UPDATE "app"."outbox" o SET "dead_at" = NULL, "attempts" = 0, "last_error" = NULL, "available_at" = now(), "locked_by" = NULL, "locked_until" = NULL WHERE (o."dead_at" IS NOT NULL) AND :condition

-- native_mysql, Postgres: destination_text
(o."destination")::text

-- native_mysql, Postgres: delivered_time
o."delivered_at"

-- native_mysql, Postgres: dead_time
o."dead_at"

-- native_mysql, Postgres: created_at
o."created_at"

-- native_mysql, Postgres: replay_set
"delivered_at" = NULL, "attempts" = 0, "available_at" = now()

-- native_mysql, Postgres: dead_table_ddl
(none)

-- native_mysql, Postgres: ddl
CREATE TABLE IF NOT EXISTS `app`.`outbox` (
    sequence_id   bigint unsigned NOT NULL AUTO_INCREMENT PRIMARY KEY,
    event_id      char(36) NOT NULL DEFAULT (UUID()),
    destination   varchar(255) NOT NULL,
    partition_key varchar(255) NULL,
    event_type    varchar(255) NOT NULL,
    payload       json NULL,
    headers       json NULL,
    mutation_id   varchar(255) NULL,
    rejected      boolean NOT NULL DEFAULT false,
    created_at    datetime(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    available_at  datetime(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    attempts      integer NOT NULL DEFAULT 0,
    last_error    text NULL,
    locked_by     varchar(64) NULL,
    locked_until  datetime(6) NULL,
    delivered_at  datetime(6) NULL,
    dead_at       datetime(6) NULL,
    UNIQUE KEY `outbox_event_id` (event_id),
    KEY `outbox_pending` (delivered_at, dead_at, sequence_id)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4;


-- native_mysql, Postgres: grants
GRANT USAGE ON SCHEMA "app" TO "relay";
GRANT SELECT, UPDATE, DELETE ON "app"."outbox" TO "relay";
-- Operators (`dead purge`, `prune`) also need DELETE on "app"."outbox".


-- native_mysql, Postgres: claim_select
SELECT (o."sequence_id")::int8, (o."event_id")::text, (o."destination")::text, (o."partition_key")::text, (o."event_type")::text, (o."payload")::text, (o."headers")::text, (o."mutation_id")::text, (CASE WHEN o."rejected" THEN 1 ELSE 0 END)::int8, (o."attempts")::int8, CASE WHEN isfinite(o."created_at") THEN (extract(epoch from o."created_at") * 1000000)::int8 WHEN o."created_at" > 'epoch' THEN 9223372036854775807 ELSE -9223372036854775807 - 1 END, NULL::int8, NULL::text, NULL::text FROM "app"."outbox" o WHERE :condition ORDER BY o."sequence_id" LIMIT $n

-- native_mysql, Postgres: claim_select locking
SELECT (o."sequence_id")::int8, (o."event_id")::text, (o."destination")::text, (o."partition_key")::text, (o."event_type")::text, (o."payload")::text, (o."headers")::text, (o."mutation_id")::text, (CASE WHEN o."rejected" THEN 1 ELSE 0 END)::int8, (o."attempts")::int8, CASE WHEN isfinite(o."created_at") THEN (extract(epoch from o."created_at") * 1000000)::int8 WHEN o."created_at" > 'epoch' THEN 9223372036854775807 ELSE -9223372036854775807 - 1 END, NULL::int8, NULL::text, NULL::text FROM "app"."outbox" o WHERE :condition ORDER BY o."sequence_id" LIMIT $n FOR UPDATE SKIP LOCKED

-- native_mysql, Postgres: claim_and_mark
WITH l AS (SELECT o."sequence_id" AS id FROM "app"."outbox" o WHERE :condition
                         ORDER BY o."sequence_id" LIMIT $n FOR UPDATE SKIP LOCKED),
                  u AS (SELECT x.id, x.k, row_number() OVER () AS n
                          FROM (SELECT o."sequence_id" AS id, coalesce((o."partition_key")::text, (o."destination")::text) AS k FROM "app"."outbox" o WHERE :condition
                                 ORDER BY o."sequence_id" LIMIT $n) x),
                  passed AS (SELECT k, min(n) AS n FROM u
                              WHERE NOT EXISTS (SELECT 1 FROM l WHERE l.id = u.id) GROUP BY k),
                  c AS (SELECT u.id, u.n FROM u JOIN l ON l.id = u.id
                          LEFT JOIN passed ON passed.k IS NOT DISTINCT FROM u.k
                         WHERE passed.n IS NULL OR u.n < passed.n)
             UPDATE "app"."outbox" o SET "locked_by" = $node, "locked_until" = now() + $lease::int8 * interval '1 millisecond' FROM c
              WHERE o."sequence_id" = c.id AND $node IS NOT NULL AND $lease >= 0
             RETURNING (o."sequence_id")::int8, (o."event_id")::text, (o."destination")::text, (o."partition_key")::text, (o."event_type")::text, (o."payload")::text, (o."headers")::text, (o."mutation_id")::text, (CASE WHEN o."rejected" THEN 1 ELSE 0 END)::int8, (o."attempts")::int8, CASE WHEN isfinite(o."created_at") THEN (extract(epoch from o."created_at") * 1000000)::int8 WHEN o."created_at" > 'epoch' THEN 9223372036854775807 ELSE -9223372036854775807 - 1 END, NULL::int8, NULL::text, NULL::text, c.n

-- native_mysql, Postgres: claim_order_column
14

-- native_mysql, Postgres: at_micros
to_timestamp(:micros::float8 / 1e6)

-- native_mysql, Postgres: destination_is
(o."destination")::text = :destination

-- native_mysql, Postgres: delivered_between
(o."delivered_at" IS NOT NULL) AND o."created_at" >= to_timestamp(:since::float8 / 1e6) AND o."created_at" < to_timestamp(:until::float8 / 1e6)

-- native_mysql, Postgres: delivered_before
(o."delivered_at" IS NOT NULL) AND o."delivered_at" < to_timestamp(:before::float8 / 1e6)

-- native_mysql, Postgres: dead_before
(o."dead_at" IS NOT NULL) AND o."dead_at" < to_timestamp(:before::float8 / 1e6)

-- native_mysql, Postgres: release_unheld
UPDATE "app"."outbox" o SET "locked_by" = NULL, "locked_until" = NULL WHERE o."locked_by" IS NOT NULL AND o."locked_by" = :node AND :not_held

-- native_mysql, Postgres: count
SELECT (count(*))::int8 FROM "app"."outbox" o WHERE :condition

-- native_mysql, Postgres: pick
SELECT (o."sequence_id")::text FROM "app"."outbox" o WHERE :condition ORDER BY o."sequence_id" LIMIT $n

-- native_mysql, Postgres: delete
DELETE FROM "app"."outbox" WHERE "sequence_id" = ANY($ids)

-- native_mysql, Postgres: delete_dead_records
DELETE FROM "app"."outbox_dead_letters" WHERE id = ANY($ids)

-- native_mysql, Postgres: retry
UPDATE "app"."outbox" o SET "locked_by" = NULL, "locked_until" = NULL, "attempts" = :attempts, "last_error" = :error, "available_at" = now() + :delay::int8 * interval '1 millisecond' WHERE o."sequence_id" = :id AND o."locked_by" = $node AND :attempts >= 0 AND :error IS NOT NULL AND :delay >= 0

-- native_mysql, Postgres: dead_letter
UPDATE "app"."outbox" o SET "dead_at" = now(), "attempts" = :attempts, "last_error" = :error, "locked_by" = NULL, "locked_until" = NULL WHERE o."sequence_id" = :id AND o."locked_by" = $node AND :attempts >= 0 AND :error IS NOT NULL

-- native_mysql, Postgres: columns_query
SELECT (column_name)::text, (data_type)::text FROM information_schema.columns WHERE table_schema = $1::text AND table_name = $2::text

-- native_mysql, Postgres: column_length_query
SELECT (character_maximum_length)::int8, (character_octet_length)::int8 FROM information_schema.columns WHERE table_schema = $3::text AND table_name = $4::text AND column_name = $5::text

-- native_mysql, Postgres: unique_column_query
SELECT count(*)::int8 FROM pg_index i JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0] WHERE i.indrelid = to_regclass($6::text) AND i.indisunique AND i.indnkeyatts = 1 AND i.indpred IS NULL AND a.attname = $7::text

-- native_mysql, Postgres: insert
INSERT INTO "app"."outbox" ("sequence_id", "destination", "event_id") VALUES ($1, $2, UUID()) RETURNING "sequence_id"

-- native_mysql, Postgres: not_in_ids
o."sequence_id" NOT IN (SELECT unnest($8::int8[]))

-- native_mysql, Postgres: not_in_texts
coalesce((o."partition_key")::text, (o."destination")::text) NOT IN (SELECT unnest($9::text[]))

-- native_mysql, MySql: table
`app`.`outbox`

-- native_mysql, MySql: dead_table
`app`.`outbox_dead_letters`

-- native_mysql, MySql: now
UTC_TIMESTAMP(6)

-- native_mysql, MySql: id_expr
(o.`sequence_id` + 0)

-- native_mysql, MySql: key_expr
coalesce(CAST(o.`partition_key` AS CHAR), CAST(o.`destination` AS CHAR))

-- native_mysql, MySql: select_list
(o.`sequence_id` + 0), CAST(o.`event_id` AS CHAR), CAST(o.`destination` AS CHAR), CAST(o.`partition_key` AS CHAR), CAST(o.`event_type` AS CHAR), o.`payload`, CAST(o.`headers` AS CHAR), CAST(o.`mutation_id` AS CHAR), CAST(CASE WHEN o.`rejected` THEN 1 ELSE 0 END AS SIGNED), CAST(o.`attempts` AS SIGNED), TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', o.`created_at`), NULL, NULL, NULL

-- native_mysql, MySql: pending
o.`delivered_at` IS NULL AND o.`dead_at` IS NULL

-- native_mysql, MySql: dead
o.`dead_at` IS NOT NULL

-- native_mysql, MySql: delivered
o.`delivered_at` IS NOT NULL

-- native_mysql, MySql: claimable
o.`delivered_at` IS NULL AND o.`dead_at` IS NULL AND (o.`locked_until` IS NULL OR o.`locked_until` < UTC_TIMESTAMP(6)) AND o.`available_at` <= UTC_TIMESTAMP(6)

-- native_mysql, MySql: order_by
o.`sequence_id`

-- native_mysql, MySql: claim_set
`locked_by` = :node, `locked_until` = UTC_TIMESTAMP(6) + INTERVAL (:lease * 1000) MICROSECOND

-- native_mysql, MySql: fence
o.`locked_by` = :node

-- native_mysql, MySql: ack
DELETE FROM `app`.`outbox` WHERE `app`.`outbox`.`sequence_id` IN (1, 2) AND `app`.`outbox`.`locked_by` = :node ORDER BY `sequence_id` LIMIT 2

-- native_mysql, MySql: retry_set
`locked_by` = NULL, `locked_until` = NULL, `attempts` = :attempts, `last_error` = :error, `available_at` = UTC_TIMESTAMP(6) + INTERVAL (:delay * 1000) MICROSECOND

-- native_mysql, MySql: dead_set
`dead_at` = UTC_TIMESTAMP(6), `attempts` = :attempts, `last_error` = :error, `locked_by` = NULL, `locked_until` = NULL

-- native_mysql, MySql: release
UPDATE `app`.`outbox` o SET o.`locked_by` = NULL, o.`locked_until` = NULL WHERE o.`sequence_id` IN (1, 2) AND o.`locked_by` = :node

-- native_mysql, MySql: release unheld
UPDATE `app`.`outbox` o SET o.`locked_by` = NULL, o.`locked_until` = NULL WHERE o.`locked_by` IS NOT NULL AND o.`locked_by` = :node AND :not_held

-- native_mysql, MySql: extend
UPDATE `app`.`outbox` o SET o.`locked_until` = UTC_TIMESTAMP(6) + INTERVAL (:lease * 1000) MICROSECOND WHERE o.`sequence_id` IN (1, 2) AND o.`locked_by` = :node AND :lease >= 0

-- native_mysql, MySql: reap to pending
UPDATE `app`.`outbox` o SET o.`locked_by` = NULL, o.`locked_until` = NULL WHERE o.`locked_by` IS NOT NULL AND (:all OR o.`locked_until` < UTC_TIMESTAMP(6)) AND :max IS NOT NULL AND :lease >= 0

-- native_mysql, MySql: reap to dead
(none)

-- native_mysql, MySql: stats
SELECT CAST(coalesce(sum(CASE WHEN o.`delivered_at` IS NULL AND o.`dead_at` IS NULL THEN 1 ELSE 0 END), 0) AS SIGNED), CAST(coalesce(sum(CASE WHEN (o.`delivered_at` IS NULL AND o.`dead_at` IS NULL) AND o.`attempts` > 0 THEN 1 ELSE 0 END), 0) AS SIGNED), CAST(coalesce(sum(CASE WHEN o.`dead_at` IS NOT NULL THEN 1 ELSE 0 END), 0) AS SIGNED), CAST(TIMESTAMPDIFF(MICROSECOND, min(CASE WHEN o.`delivered_at` IS NULL AND o.`dead_at` IS NULL THEN CASE WHEN o.`attempts` > 0 THEN o.`created_at` WHEN o.`available_at` IS NULL THEN o.`created_at` WHEN o.`available_at` <= UTC_TIMESTAMP(6) THEN (CASE WHEN o.`available_at` > o.`created_at` THEN o.`available_at` ELSE o.`created_at` END) END END), UTC_TIMESTAMP(6)) / 1000 AS SIGNED) FROM `app`.`outbox` o WHERE (o.`delivered_at` IS NULL AND o.`dead_at` IS NULL) OR (o.`dead_at` IS NOT NULL)

-- native_mysql, MySql: stats by destination
SELECT CAST(o.`destination` AS CHAR), CAST(coalesce(sum(CASE WHEN o.`delivered_at` IS NULL AND o.`dead_at` IS NULL THEN 1 ELSE 0 END), 0) AS SIGNED), CAST(coalesce(sum(CASE WHEN (o.`delivered_at` IS NULL AND o.`dead_at` IS NULL) AND o.`attempts` > 0 THEN 1 ELSE 0 END), 0) AS SIGNED), CAST(coalesce(sum(CASE WHEN o.`dead_at` IS NOT NULL THEN 1 ELSE 0 END), 0) AS SIGNED), CAST(TIMESTAMPDIFF(MICROSECOND, min(CASE WHEN o.`delivered_at` IS NULL AND o.`dead_at` IS NULL THEN CASE WHEN o.`attempts` > 0 THEN o.`created_at` WHEN o.`available_at` IS NULL THEN o.`created_at` WHEN o.`available_at` <= UTC_TIMESTAMP(6) THEN (CASE WHEN o.`available_at` > o.`created_at` THEN o.`available_at` ELSE o.`created_at` END) END END), UTC_TIMESTAMP(6)) / 1000 AS SIGNED) FROM `app`.`outbox` o WHERE (o.`delivered_at` IS NULL AND o.`dead_at` IS NULL) OR (o.`dead_at` IS NOT NULL) GROUP BY CAST(o.`destination` AS CHAR) ORDER BY CAST(o.`destination` AS CHAR)

-- native_mysql, MySql: dead_list
SELECT CAST(o.`sequence_id` AS CHAR), CAST(o.`event_id` AS CHAR), CAST(o.`destination` AS CHAR), CAST(o.`event_type` AS CHAR), CAST(o.`attempts` AS SIGNED), CAST(o.`last_error` AS CHAR), TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', o.`dead_at`) FROM `app`.`outbox` o WHERE o.`dead_at` IS NOT NULL AND :filter ORDER BY o.`sequence_id` LIMIT :n

-- native_mysql, MySql: event
SELECT (o.`sequence_id` + 0), CAST(o.`event_id` AS CHAR), CAST(o.`destination` AS CHAR), CAST(o.`partition_key` AS CHAR), CAST(o.`event_type` AS CHAR), o.`payload`, CAST(o.`headers` AS CHAR), CAST(o.`mutation_id` AS CHAR), CAST(CASE WHEN o.`rejected` THEN 1 ELSE 0 END AS SIGNED), CAST(o.`attempts` AS SIGNED), TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', o.`created_at`), NULL, NULL, NULL, CAST((CASE WHEN o.`dead_at` IS NOT NULL THEN 2 WHEN o.`delivered_at` IS NOT NULL THEN 1 ELSE 0 END) AS SIGNED), CAST(o.`attempts` AS SIGNED), CAST(o.`last_error` AS CHAR), TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', o.`dead_at`) FROM `app`.`outbox` o WHERE :condition

-- native_mysql, MySql: dead_retry
UPDATE `app`.`outbox` o SET o.`dead_at` = NULL, o.`attempts` = 0, o.`last_error` = NULL, o.`available_at` = UTC_TIMESTAMP(6), o.`locked_by` = NULL, o.`locked_until` = NULL WHERE (o.`dead_at` IS NOT NULL) AND :condition

-- native_mysql, MySql: destination_text
CAST(o.`destination` AS CHAR)

-- native_mysql, MySql: delivered_time
o.`delivered_at`

-- native_mysql, MySql: dead_time
o.`dead_at`

-- native_mysql, MySql: created_at
o.`created_at`

-- native_mysql, MySql: replay_set
`delivered_at` = NULL, `attempts` = 0, `available_at` = UTC_TIMESTAMP(6)

-- native_mysql, MySql: dead_table_ddl
(none)

-- native_mysql, MySql: ddl
CREATE TABLE IF NOT EXISTS `app`.`outbox` (
    sequence_id   bigint unsigned NOT NULL AUTO_INCREMENT PRIMARY KEY,
    event_id      char(36) NOT NULL DEFAULT (UUID()),
    destination   varchar(255) NOT NULL,
    partition_key varchar(255) NULL,
    event_type    varchar(255) NOT NULL,
    payload       json NULL,
    headers       json NULL,
    mutation_id   varchar(255) NULL,
    rejected      boolean NOT NULL DEFAULT false,
    created_at    datetime(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    available_at  datetime(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    attempts      integer NOT NULL DEFAULT 0,
    last_error    text NULL,
    locked_by     varchar(64) NULL,
    locked_until  datetime(6) NULL,
    delivered_at  datetime(6) NULL,
    dead_at       datetime(6) NULL,
    UNIQUE KEY `outbox_event_id` (event_id),
    KEY `outbox_pending` (delivered_at, dead_at, sequence_id)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4;


-- native_mysql, MySql: grants
GRANT SELECT, UPDATE, DELETE ON `app`.`outbox` TO 'relay'@'%';
-- Operators (`dead purge`, `prune`) also need DELETE on `app`.`outbox`.


-- native_mysql, MySql: claim_select
SELECT (o.`sequence_id` + 0), CAST(o.`event_id` AS CHAR), CAST(o.`destination` AS CHAR), CAST(o.`partition_key` AS CHAR), CAST(o.`event_type` AS CHAR), o.`payload`, CAST(o.`headers` AS CHAR), CAST(o.`mutation_id` AS CHAR), CAST(CASE WHEN o.`rejected` THEN 1 ELSE 0 END AS SIGNED), CAST(o.`attempts` AS SIGNED), TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', o.`created_at`), NULL, NULL, NULL FROM `app`.`outbox` o WHERE :condition ORDER BY o.`sequence_id` LIMIT :n

-- native_mysql, MySql: claim_select locking
SELECT (o.`sequence_id` + 0), CAST(o.`event_id` AS CHAR), CAST(o.`destination` AS CHAR), CAST(o.`partition_key` AS CHAR), CAST(o.`event_type` AS CHAR), o.`payload`, CAST(o.`headers` AS CHAR), CAST(o.`mutation_id` AS CHAR), CAST(CASE WHEN o.`rejected` THEN 1 ELSE 0 END AS SIGNED), CAST(o.`attempts` AS SIGNED), TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', o.`created_at`), NULL, NULL, NULL FROM `app`.`outbox` o WHERE :condition ORDER BY o.`sequence_id` LIMIT :n FOR UPDATE SKIP LOCKED

-- native_mysql, MySql: claim_and_mark
WITH l AS (SELECT o.`sequence_id` AS id FROM `app`.`outbox` o WHERE :condition
                         ORDER BY o.`sequence_id` LIMIT :n FOR UPDATE SKIP LOCKED),
                  u AS (SELECT x.id, x.k, row_number() OVER () AS n
                          FROM (SELECT o.`sequence_id` AS id, coalesce(CAST(o.`partition_key` AS CHAR), CAST(o.`destination` AS CHAR)) AS k FROM `app`.`outbox` o WHERE :condition
                                 ORDER BY o.`sequence_id` LIMIT :n) x),
                  passed AS (SELECT k, min(n) AS n FROM u
                              WHERE NOT EXISTS (SELECT 1 FROM l WHERE l.id = u.id) GROUP BY k),
                  c AS (SELECT u.id, u.n FROM u JOIN l ON l.id = u.id
                          LEFT JOIN passed ON passed.k IS NOT DISTINCT FROM u.k
                         WHERE passed.n IS NULL OR u.n < passed.n)
             UPDATE `app`.`outbox` o SET `locked_by` = :node, `locked_until` = UTC_TIMESTAMP(6) + INTERVAL (:lease * 1000) MICROSECOND FROM c
              WHERE o.`sequence_id` = c.id AND :node IS NOT NULL AND :lease >= 0
             RETURNING (o.`sequence_id` + 0), CAST(o.`event_id` AS CHAR), CAST(o.`destination` AS CHAR), CAST(o.`partition_key` AS CHAR), CAST(o.`event_type` AS CHAR), o.`payload`, CAST(o.`headers` AS CHAR), CAST(o.`mutation_id` AS CHAR), CAST(CASE WHEN o.`rejected` THEN 1 ELSE 0 END AS SIGNED), CAST(o.`attempts` AS SIGNED), TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', o.`created_at`), NULL, NULL, NULL, c.n

-- native_mysql, MySql: claim_order_column
14

-- native_mysql, MySql: at_micros
FROM_UNIXTIME(:micros / 1000000)

-- native_mysql, MySql: destination_is
CAST(CAST(o.`destination` AS CHAR) AS BINARY) = CAST(:destination AS BINARY)

-- native_mysql, MySql: delivered_between
(o.`delivered_at` IS NOT NULL) AND o.`created_at` >= FROM_UNIXTIME(:since / 1000000) AND o.`created_at` < FROM_UNIXTIME(:until / 1000000)

-- native_mysql, MySql: delivered_before
(o.`delivered_at` IS NOT NULL) AND o.`delivered_at` < FROM_UNIXTIME(:before / 1000000)

-- native_mysql, MySql: dead_before
(o.`dead_at` IS NOT NULL) AND o.`dead_at` < FROM_UNIXTIME(:before / 1000000)

-- native_mysql, MySql: release_unheld
UPDATE `app`.`outbox` o SET o.`locked_by` = NULL, o.`locked_until` = NULL WHERE o.`locked_by` IS NOT NULL AND o.`locked_by` = :node AND :not_held

-- native_mysql, MySql: count
SELECT CAST(count(*) AS SIGNED) FROM `app`.`outbox` o WHERE :condition

-- native_mysql, MySql: pick
SELECT CAST(o.`sequence_id` AS CHAR) FROM `app`.`outbox` o WHERE :condition ORDER BY o.`sequence_id` LIMIT :n

-- native_mysql, MySql: delete
DELETE FROM `app`.`outbox` WHERE `sequence_id` IN (1, 2)

-- native_mysql, MySql: delete_dead_records
DELETE FROM `app`.`outbox_dead_letters` WHERE id IN (1, 2)

-- native_mysql, MySql: retry
UPDATE `app`.`outbox` o SET o.`locked_by` = NULL, o.`locked_until` = NULL, o.`attempts` = :attempts, o.`last_error` = :error, o.`available_at` = UTC_TIMESTAMP(6) + INTERVAL (:delay * 1000) MICROSECOND WHERE o.`sequence_id` = :id AND o.`locked_by` = :node AND :attempts >= 0 AND :error IS NOT NULL AND :delay >= 0

-- native_mysql, MySql: dead_letter
UPDATE `app`.`outbox` o SET o.`dead_at` = UTC_TIMESTAMP(6), o.`attempts` = :attempts, o.`last_error` = :error, o.`locked_by` = NULL, o.`locked_until` = NULL WHERE o.`sequence_id` = :id AND o.`locked_by` = :node AND :attempts >= 0 AND :error IS NOT NULL

-- native_mysql, MySql: columns_query
SELECT CAST(column_name AS CHAR), CAST(data_type AS CHAR) FROM information_schema.columns WHERE table_schema = :p1 AND table_name = :p2

-- native_mysql, MySql: column_length_query
SELECT CAST(character_maximum_length AS SIGNED), CAST(character_octet_length AS SIGNED) FROM information_schema.columns WHERE table_schema = :p3 AND table_name = :p4 AND column_name = :p5

-- native_mysql, MySql: unique_column_query
SELECT CAST(COUNT(*) AS SIGNED) FROM (SELECT index_name FROM information_schema.statistics WHERE table_schema = :p6 AND table_name = :p7 AND non_unique = 0 GROUP BY index_name HAVING COUNT(*) = 1 AND MAX(column_name) = :p8 AND MAX(sub_part) IS NULL) u

-- native_mysql, MySql: insert
INSERT INTO `app`.`outbox` (`sequence_id`, `destination`, `event_id`) VALUES (?, ?, UUID())

-- native_mysql, MySql: not_in_ids
o.`sequence_id` NOT IN (1, 2)

-- native_mysql, MySql: not_in_texts
CAST(coalesce(CAST(o.`partition_key` AS CHAR), CAST(o.`destination` AS CHAR)) AS BINARY) NOT IN (CAST(:p9 AS BINARY), CAST(:p10 AS BINARY))

-- native_mysql retained, Postgres: table
"outbox"

-- native_mysql retained, Postgres: dead_table
"outbox_dead_letters"

-- native_mysql retained, Postgres: now
now()

-- native_mysql retained, Postgres: id_expr
(o."sequence_id")::int8

-- native_mysql retained, Postgres: key_expr
coalesce((o."partition_key")::text, (o."destination")::text)

-- native_mysql retained, Postgres: select_list
(o."sequence_id")::int8, (o."event_id")::text, (o."destination")::text, (o."partition_key")::text, (o."event_type")::text, (o."payload")::text, (o."headers")::text, (o."mutation_id")::text, (CASE WHEN o."rejected" THEN 1 ELSE 0 END)::int8, (o."attempts")::int8, CASE WHEN isfinite(o."created_at") THEN (extract(epoch from o."created_at") * 1000000)::int8 WHEN o."created_at" > 'epoch' THEN 9223372036854775807 ELSE -9223372036854775807 - 1 END, NULL::int8, NULL::text, NULL::text

-- native_mysql retained, Postgres: pending
o."delivered_at" IS NULL AND o."dead_at" IS NULL

-- native_mysql retained, Postgres: dead
o."dead_at" IS NOT NULL

-- native_mysql retained, Postgres: delivered
o."delivered_at" IS NOT NULL

-- native_mysql retained, Postgres: claimable
o."delivered_at" IS NULL AND o."dead_at" IS NULL AND (o."locked_until" IS NULL OR o."locked_until" < now()) AND o."available_at" <= now()

-- native_mysql retained, Postgres: order_by
o."sequence_id"

-- native_mysql retained, Postgres: claim_set
"locked_by" = $node, "locked_until" = now() + $lease::int8 * interval '1 millisecond'

-- native_mysql retained, Postgres: fence
o."locked_by" = $node

-- native_mysql retained, Postgres: ack
UPDATE "outbox" o SET "delivered_at" = now(), "locked_by" = NULL, "locked_until" = NULL WHERE o."sequence_id" = ANY($ids) AND o."locked_by" = $node

-- native_mysql retained, Postgres: retry_set
"locked_by" = NULL, "locked_until" = NULL, "attempts" = :attempts, "last_error" = :error, "available_at" = now() + :delay::int8 * interval '1 millisecond'

-- native_mysql retained, Postgres: dead_set
"dead_at" = now(), "attempts" = :attempts, "last_error" = :error, "locked_by" = NULL, "locked_until" = NULL

-- native_mysql retained, Postgres: release
UPDATE "outbox" o SET "locked_by" = NULL, "locked_until" = NULL WHERE o."sequence_id" = ANY($ids) AND o."locked_by" = $node

-- native_mysql retained, Postgres: release unheld
UPDATE "outbox" o SET "locked_by" = NULL, "locked_until" = NULL WHERE o."locked_by" IS NOT NULL AND o."locked_by" = $node AND :not_held

-- native_mysql retained, Postgres: extend
UPDATE "outbox" o SET "locked_until" = now() + $lease::int8 * interval '1 millisecond' WHERE o."sequence_id" = ANY($ids) AND o."locked_by" = $node AND $lease >= 0

-- native_mysql retained, Postgres: reap to pending
UPDATE "outbox" o SET "locked_by" = NULL, "locked_until" = NULL WHERE o."locked_by" IS NOT NULL AND (:all OR o."locked_until" < now()) AND :max IS NOT NULL AND $lease >= 0

-- native_mysql retained, Postgres: reap to dead
(none)

-- native_mysql retained, Postgres: stats
SELECT (coalesce(sum(CASE WHEN o."delivered_at" IS NULL AND o."dead_at" IS NULL THEN 1 ELSE 0 END), 0))::int8, (coalesce(sum(CASE WHEN (o."delivered_at" IS NULL AND o."dead_at" IS NULL) AND o."attempts" > 0 THEN 1 ELSE 0 END), 0))::int8, (coalesce(sum(CASE WHEN o."dead_at" IS NOT NULL THEN 1 ELSE 0 END), 0))::int8, (extract(epoch from now() - min(CASE WHEN o."delivered_at" IS NULL AND o."dead_at" IS NULL AND isfinite(o."created_at") THEN CASE WHEN o."attempts" > 0 THEN o."created_at" WHEN o."available_at" IS NULL THEN o."created_at" WHEN o."available_at" <= now() THEN (CASE WHEN o."available_at" > o."created_at" THEN o."available_at" ELSE o."created_at" END) END END)) * 1000)::int8 FROM "outbox" o WHERE (o."delivered_at" IS NULL AND o."dead_at" IS NULL) OR (o."dead_at" IS NOT NULL)

-- native_mysql retained, Postgres: stats by destination
SELECT (o."destination")::text, (coalesce(sum(CASE WHEN o."delivered_at" IS NULL AND o."dead_at" IS NULL THEN 1 ELSE 0 END), 0))::int8, (coalesce(sum(CASE WHEN (o."delivered_at" IS NULL AND o."dead_at" IS NULL) AND o."attempts" > 0 THEN 1 ELSE 0 END), 0))::int8, (coalesce(sum(CASE WHEN o."dead_at" IS NOT NULL THEN 1 ELSE 0 END), 0))::int8, (extract(epoch from now() - min(CASE WHEN o."delivered_at" IS NULL AND o."dead_at" IS NULL AND isfinite(o."created_at") THEN CASE WHEN o."attempts" > 0 THEN o."created_at" WHEN o."available_at" IS NULL THEN o."created_at" WHEN o."available_at" <= now() THEN (CASE WHEN o."available_at" > o."created_at" THEN o."available_at" ELSE o."created_at" END) END END)) * 1000)::int8 FROM "outbox" o WHERE (o."delivered_at" IS NULL AND o."dead_at" IS NULL) OR (o."dead_at" IS NOT NULL) GROUP BY (o."destination")::text ORDER BY (o."destination")::text

-- native_mysql retained, Postgres: dead_list
SELECT (o."sequence_id")::text, (o."event_id")::text, (o."destination")::text, (o."event_type")::text, (o."attempts")::int8, (o."last_error")::text, CASE WHEN isfinite(o."dead_at") THEN (extract(epoch from o."dead_at") * 1000000)::int8 WHEN o."dead_at" > 'epoch' THEN 9223372036854775807 ELSE -9223372036854775807 - 1 END FROM "outbox" o WHERE o."dead_at" IS NOT NULL AND :filter ORDER BY o."sequence_id" LIMIT $n

-- native_mysql retained, Postgres: event
SELECT (o."sequence_id")::int8, (o."event_id")::text, (o."destination")::text, (o."partition_key")::text, (o."event_type")::text, (o."payload")::text, (o."headers")::text, (o."mutation_id")::text, (CASE WHEN o."rejected" THEN 1 ELSE 0 END)::int8, (o."attempts")::int8, CASE WHEN isfinite(o."created_at") THEN (extract(epoch from o."created_at") * 1000000)::int8 WHEN o."created_at" > 'epoch' THEN 9223372036854775807 ELSE -9223372036854775807 - 1 END, NULL::int8, NULL::text, NULL::text, ((CASE WHEN o."dead_at" IS NOT NULL THEN 2 WHEN o."delivered_at" IS NOT NULL THEN 1 ELSE 0 END))::int8, (o."attempts")::int8, (o."last_error")::text, CASE WHEN isfinite(o."dead_at") THEN (extract(epoch from o."dead_at") * 1000000)::int8 WHEN o."dead_at" > 'epoch' THEN 9223372036854775807 ELSE -9223372036854775807 - 1 END FROM "outbox" o WHERE :condition

-- native_mysql retained, Postgres: dead_retry
UPDATE "outbox" o SET "dead_at" = NULL, "attempts" = 0, "last_error" = NULL, "available_at" = now(), "locked_by" = NULL, "locked_until" = NULL WHERE (o."dead_at" IS NOT NULL) AND :condition

-- native_mysql retained, Postgres: destination_text
(o."destination")::text

-- native_mysql retained, Postgres: delivered_time
o."delivered_at"

-- native_mysql retained, Postgres: dead_time
o."dead_at"

-- native_mysql retained, Postgres: created_at
o."created_at"

-- native_mysql retained, Postgres: replay_set
"delivered_at" = NULL, "attempts" = 0, "available_at" = now()

-- native_mysql retained, Postgres: dead_table_ddl
(none)

-- native_mysql retained, Postgres: ddl
CREATE TABLE IF NOT EXISTS `outbox` (
    sequence_id   bigint unsigned NOT NULL AUTO_INCREMENT PRIMARY KEY,
    event_id      char(36) NOT NULL DEFAULT (UUID()),
    destination   varchar(255) NOT NULL,
    partition_key varchar(255) NULL,
    event_type    varchar(255) NOT NULL,
    payload       json NULL,
    headers       json NULL,
    mutation_id   varchar(255) NULL,
    rejected      boolean NOT NULL DEFAULT false,
    created_at    datetime(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    available_at  datetime(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    attempts      integer NOT NULL DEFAULT 0,
    last_error    text NULL,
    locked_by     varchar(64) NULL,
    locked_until  datetime(6) NULL,
    delivered_at  datetime(6) NULL,
    dead_at       datetime(6) NULL,
    UNIQUE KEY `outbox_event_id` (event_id),
    KEY `outbox_pending` (delivered_at, dead_at, sequence_id)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4;


-- native_mysql retained, Postgres: grants
GRANT SELECT, UPDATE ON "outbox" TO "relay";
-- Operators (`dead purge`, `prune`) also need DELETE on "outbox".


-- native_mysql retained, Postgres: claim_select
SELECT (o."sequence_id")::int8, (o."event_id")::text, (o."destination")::text, (o."partition_key")::text, (o."event_type")::text, (o."payload")::text, (o."headers")::text, (o."mutation_id")::text, (CASE WHEN o."rejected" THEN 1 ELSE 0 END)::int8, (o."attempts")::int8, CASE WHEN isfinite(o."created_at") THEN (extract(epoch from o."created_at") * 1000000)::int8 WHEN o."created_at" > 'epoch' THEN 9223372036854775807 ELSE -9223372036854775807 - 1 END, NULL::int8, NULL::text, NULL::text FROM "outbox" o WHERE :condition ORDER BY o."sequence_id" LIMIT $n

-- native_mysql retained, Postgres: claim_select locking
SELECT (o."sequence_id")::int8, (o."event_id")::text, (o."destination")::text, (o."partition_key")::text, (o."event_type")::text, (o."payload")::text, (o."headers")::text, (o."mutation_id")::text, (CASE WHEN o."rejected" THEN 1 ELSE 0 END)::int8, (o."attempts")::int8, CASE WHEN isfinite(o."created_at") THEN (extract(epoch from o."created_at") * 1000000)::int8 WHEN o."created_at" > 'epoch' THEN 9223372036854775807 ELSE -9223372036854775807 - 1 END, NULL::int8, NULL::text, NULL::text FROM "outbox" o WHERE :condition ORDER BY o."sequence_id" LIMIT $n FOR UPDATE SKIP LOCKED

-- native_mysql retained, Postgres: claim_and_mark
WITH l AS (SELECT o."sequence_id" AS id FROM "outbox" o WHERE :condition
                         ORDER BY o."sequence_id" LIMIT $n FOR UPDATE SKIP LOCKED),
                  u AS (SELECT x.id, x.k, row_number() OVER () AS n
                          FROM (SELECT o."sequence_id" AS id, coalesce((o."partition_key")::text, (o."destination")::text) AS k FROM "outbox" o WHERE :condition
                                 ORDER BY o."sequence_id" LIMIT $n) x),
                  passed AS (SELECT k, min(n) AS n FROM u
                              WHERE NOT EXISTS (SELECT 1 FROM l WHERE l.id = u.id) GROUP BY k),
                  c AS (SELECT u.id, u.n FROM u JOIN l ON l.id = u.id
                          LEFT JOIN passed ON passed.k IS NOT DISTINCT FROM u.k
                         WHERE passed.n IS NULL OR u.n < passed.n)
             UPDATE "outbox" o SET "locked_by" = $node, "locked_until" = now() + $lease::int8 * interval '1 millisecond' FROM c
              WHERE o."sequence_id" = c.id AND $node IS NOT NULL AND $lease >= 0
             RETURNING (o."sequence_id")::int8, (o."event_id")::text, (o."destination")::text, (o."partition_key")::text, (o."event_type")::text, (o."payload")::text, (o."headers")::text, (o."mutation_id")::text, (CASE WHEN o."rejected" THEN 1 ELSE 0 END)::int8, (o."attempts")::int8, CASE WHEN isfinite(o."created_at") THEN (extract(epoch from o."created_at") * 1000000)::int8 WHEN o."created_at" > 'epoch' THEN 9223372036854775807 ELSE -9223372036854775807 - 1 END, NULL::int8, NULL::text, NULL::text, c.n

-- native_mysql retained, Postgres: claim_order_column
14

-- native_mysql retained, Postgres: at_micros
to_timestamp(:micros::float8 / 1e6)

-- native_mysql retained, Postgres: destination_is
(o."destination")::text = :destination

-- native_mysql retained, Postgres: delivered_between
(o."delivered_at" IS NOT NULL) AND o."created_at" >= to_timestamp(:since::float8 / 1e6) AND o."created_at" < to_timestamp(:until::float8 / 1e6)

-- native_mysql retained, Postgres: delivered_before
(o."delivered_at" IS NOT NULL) AND o."delivered_at" < to_timestamp(:before::float8 / 1e6)

-- native_mysql retained, Postgres: dead_before
(o."dead_at" IS NOT NULL) AND o."dead_at" < to_timestamp(:before::float8 / 1e6)

-- native_mysql retained, Postgres: release_unheld
UPDATE "outbox" o SET "locked_by" = NULL, "locked_until" = NULL WHERE o."locked_by" IS NOT NULL AND o."locked_by" = :node AND :not_held

-- native_mysql retained, Postgres: count
SELECT (count(*))::int8 FROM "outbox" o WHERE :condition

-- native_mysql retained, Postgres: pick
SELECT (o."sequence_id")::text FROM "outbox" o WHERE :condition ORDER BY o."sequence_id" LIMIT $n

-- native_mysql retained, Postgres: delete
DELETE FROM "outbox" WHERE "sequence_id" = ANY($ids)

-- native_mysql retained, Postgres: delete_dead_records
DELETE FROM "outbox_dead_letters" WHERE id = ANY($ids)

-- native_mysql retained, Postgres: retry
UPDATE "outbox" o SET "locked_by" = NULL, "locked_until" = NULL, "attempts" = :attempts, "last_error" = :error, "available_at" = now() + :delay::int8 * interval '1 millisecond' WHERE o."sequence_id" = :id AND o."locked_by" = $node AND :attempts >= 0 AND :error IS NOT NULL AND :delay >= 0

-- native_mysql retained, Postgres: dead_letter
UPDATE "outbox" o SET "dead_at" = now(), "attempts" = :attempts, "last_error" = :error, "locked_by" = NULL, "locked_until" = NULL WHERE o."sequence_id" = :id AND o."locked_by" = $node AND :attempts >= 0 AND :error IS NOT NULL

-- native_mysql retained, Postgres: columns_query
SELECT (column_name)::text, (data_type)::text FROM information_schema.columns WHERE table_schema = $1::text AND table_name = $2::text

-- native_mysql retained, Postgres: column_length_query
SELECT (character_maximum_length)::int8, (character_octet_length)::int8 FROM information_schema.columns WHERE table_schema = $3::text AND table_name = $4::text AND column_name = $5::text

-- native_mysql retained, Postgres: unique_column_query
SELECT count(*)::int8 FROM pg_index i JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0] WHERE i.indrelid = to_regclass($6::text) AND i.indisunique AND i.indnkeyatts = 1 AND i.indpred IS NULL AND a.attname = $7::text

-- native_mysql retained, Postgres: insert
INSERT INTO "outbox" ("sequence_id", "destination", "event_id") VALUES ($1, $2, UUID()) RETURNING "sequence_id"

-- native_mysql retained, Postgres: not_in_ids
o."sequence_id" NOT IN (SELECT unnest($8::int8[]))

-- native_mysql retained, Postgres: not_in_texts
coalesce((o."partition_key")::text, (o."destination")::text) NOT IN (SELECT unnest($9::text[]))

-- native_mysql retained, MySql: table
`outbox`

-- native_mysql retained, MySql: dead_table
`outbox_dead_letters`

-- native_mysql retained, MySql: now
UTC_TIMESTAMP(6)

-- native_mysql retained, MySql: id_expr
(o.`sequence_id` + 0)

-- native_mysql retained, MySql: key_expr
coalesce(CAST(o.`partition_key` AS CHAR), CAST(o.`destination` AS CHAR))

-- native_mysql retained, MySql: select_list
(o.`sequence_id` + 0), CAST(o.`event_id` AS CHAR), CAST(o.`destination` AS CHAR), CAST(o.`partition_key` AS CHAR), CAST(o.`event_type` AS CHAR), o.`payload`, CAST(o.`headers` AS CHAR), CAST(o.`mutation_id` AS CHAR), CAST(CASE WHEN o.`rejected` THEN 1 ELSE 0 END AS SIGNED), CAST(o.`attempts` AS SIGNED), TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', o.`created_at`), NULL, NULL, NULL

-- native_mysql retained, MySql: pending
o.`delivered_at` IS NULL AND o.`dead_at` IS NULL

-- native_mysql retained, MySql: dead
o.`dead_at` IS NOT NULL

-- native_mysql retained, MySql: delivered
o.`delivered_at` IS NOT NULL

-- native_mysql retained, MySql: claimable
o.`delivered_at` IS NULL AND o.`dead_at` IS NULL AND (o.`locked_until` IS NULL OR o.`locked_until` < UTC_TIMESTAMP(6)) AND o.`available_at` <= UTC_TIMESTAMP(6)

-- native_mysql retained, MySql: order_by
o.`sequence_id`

-- native_mysql retained, MySql: claim_set
`locked_by` = :node, `locked_until` = UTC_TIMESTAMP(6) + INTERVAL (:lease * 1000) MICROSECOND

-- native_mysql retained, MySql: fence
o.`locked_by` = :node

-- native_mysql retained, MySql: ack
UPDATE `outbox` o SET o.`delivered_at` = UTC_TIMESTAMP(6), o.`locked_by` = NULL, o.`locked_until` = NULL WHERE o.`sequence_id` IN (1, 2) AND o.`locked_by` = :node ORDER BY `sequence_id` LIMIT 2

-- native_mysql retained, MySql: retry_set
`locked_by` = NULL, `locked_until` = NULL, `attempts` = :attempts, `last_error` = :error, `available_at` = UTC_TIMESTAMP(6) + INTERVAL (:delay * 1000) MICROSECOND

-- native_mysql retained, MySql: dead_set
`dead_at` = UTC_TIMESTAMP(6), `attempts` = :attempts, `last_error` = :error, `locked_by` = NULL, `locked_until` = NULL

-- native_mysql retained, MySql: release
UPDATE `outbox` o SET o.`locked_by` = NULL, o.`locked_until` = NULL WHERE o.`sequence_id` IN (1, 2) AND o.`locked_by` = :node

-- native_mysql retained, MySql: release unheld
UPDATE `outbox` o SET o.`locked_by` = NULL, o.`locked_until` = NULL WHERE o.`locked_by` IS NOT NULL AND o.`locked_by` = :node AND :not_held

-- native_mysql retained, MySql: extend
UPDATE `outbox` o SET o.`locked_until` = UTC_TIMESTAMP(6) + INTERVAL (:lease * 1000) MICROSECOND WHERE o.`sequence_id` IN (1, 2) AND o.`locked_by` = :node AND :lease >= 0

-- native_mysql retained, MySql: reap to pending
UPDATE `outbox` o SET o.`locked_by` = NULL, o.`locked_until` = NULL WHERE o.`locked_by` IS NOT NULL AND (:all OR o.`locked_until` < UTC_TIMESTAMP(6)) AND :max IS NOT NULL AND :lease >= 0

-- native_mysql retained, MySql: reap to dead
(none)

-- native_mysql retained, MySql: stats
SELECT CAST(coalesce(sum(CASE WHEN o.`delivered_at` IS NULL AND o.`dead_at` IS NULL THEN 1 ELSE 0 END), 0) AS SIGNED), CAST(coalesce(sum(CASE WHEN (o.`delivered_at` IS NULL AND o.`dead_at` IS NULL) AND o.`attempts` > 0 THEN 1 ELSE 0 END), 0) AS SIGNED), CAST(coalesce(sum(CASE WHEN o.`dead_at` IS NOT NULL THEN 1 ELSE 0 END), 0) AS SIGNED), CAST(TIMESTAMPDIFF(MICROSECOND, min(CASE WHEN o.`delivered_at` IS NULL AND o.`dead_at` IS NULL THEN CASE WHEN o.`attempts` > 0 THEN o.`created_at` WHEN o.`available_at` IS NULL THEN o.`created_at` WHEN o.`available_at` <= UTC_TIMESTAMP(6) THEN (CASE WHEN o.`available_at` > o.`created_at` THEN o.`available_at` ELSE o.`created_at` END) END END), UTC_TIMESTAMP(6)) / 1000 AS SIGNED) FROM `outbox` o WHERE (o.`delivered_at` IS NULL AND o.`dead_at` IS NULL) OR (o.`dead_at` IS NOT NULL)

-- native_mysql retained, MySql: stats by destination
SELECT CAST(o.`destination` AS CHAR), CAST(coalesce(sum(CASE WHEN o.`delivered_at` IS NULL AND o.`dead_at` IS NULL THEN 1 ELSE 0 END), 0) AS SIGNED), CAST(coalesce(sum(CASE WHEN (o.`delivered_at` IS NULL AND o.`dead_at` IS NULL) AND o.`attempts` > 0 THEN 1 ELSE 0 END), 0) AS SIGNED), CAST(coalesce(sum(CASE WHEN o.`dead_at` IS NOT NULL THEN 1 ELSE 0 END), 0) AS SIGNED), CAST(TIMESTAMPDIFF(MICROSECOND, min(CASE WHEN o.`delivered_at` IS NULL AND o.`dead_at` IS NULL THEN CASE WHEN o.`attempts` > 0 THEN o.`created_at` WHEN o.`available_at` IS NULL THEN o.`created_at` WHEN o.`available_at` <= UTC_TIMESTAMP(6) THEN (CASE WHEN o.`available_at` > o.`created_at` THEN o.`available_at` ELSE o.`created_at` END) END END), UTC_TIMESTAMP(6)) / 1000 AS SIGNED) FROM `outbox` o WHERE (o.`delivered_at` IS NULL AND o.`dead_at` IS NULL) OR (o.`dead_at` IS NOT NULL) GROUP BY CAST(o.`destination` AS CHAR) ORDER BY CAST(o.`destination` AS CHAR)

-- native_mysql retained, MySql: dead_list
SELECT CAST(o.`sequence_id` AS CHAR), CAST(o.`event_id` AS CHAR), CAST(o.`destination` AS CHAR), CAST(o.`event_type` AS CHAR), CAST(o.`attempts` AS SIGNED), CAST(o.`last_error` AS CHAR), TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', o.`dead_at`) FROM `outbox` o WHERE o.`dead_at` IS NOT NULL AND :filter ORDER BY o.`sequence_id` LIMIT :n

-- native_mysql retained, MySql: event
SELECT (o.`sequence_id` + 0), CAST(o.`event_id` AS CHAR), CAST(o.`destination` AS CHAR), CAST(o.`partition_key` AS CHAR), CAST(o.`event_type` AS CHAR), o.`payload`, CAST(o.`headers` AS CHAR), CAST(o.`mutation_id` AS CHAR), CAST(CASE WHEN o.`rejected` THEN 1 ELSE 0 END AS SIGNED), CAST(o.`attempts` AS SIGNED), TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', o.`created_at`), NULL, NULL, NULL, CAST((CASE WHEN o.`dead_at` IS NOT NULL THEN 2 WHEN o.`delivered_at` IS NOT NULL THEN 1 ELSE 0 END) AS SIGNED), CAST(o.`attempts` AS SIGNED), CAST(o.`last_error` AS CHAR), TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', o.`dead_at`) FROM `outbox` o WHERE :condition

-- native_mysql retained, MySql: dead_retry
UPDATE `outbox` o SET o.`dead_at` = NULL, o.`attempts` = 0, o.`last_error` = NULL, o.`available_at` = UTC_TIMESTAMP(6), o.`locked_by` = NULL, o.`locked_until` = NULL WHERE (o.`dead_at` IS NOT NULL) AND :condition

-- native_mysql retained, MySql: destination_text
CAST(o.`destination` AS CHAR)

-- native_mysql retained, MySql: delivered_time
o.`delivered_at`

-- native_mysql retained, MySql: dead_time
o.`dead_at`

-- native_mysql retained, MySql: created_at
o.`created_at`

-- native_mysql retained, MySql: replay_set
`delivered_at` = NULL, `attempts` = 0, `available_at` = UTC_TIMESTAMP(6)

-- native_mysql retained, MySql: dead_table_ddl
(none)

-- native_mysql retained, MySql: ddl
CREATE TABLE IF NOT EXISTS `outbox` (
    sequence_id   bigint unsigned NOT NULL AUTO_INCREMENT PRIMARY KEY,
    event_id      char(36) NOT NULL DEFAULT (UUID()),
    destination   varchar(255) NOT NULL,
    partition_key varchar(255) NULL,
    event_type    varchar(255) NOT NULL,
    payload       json NULL,
    headers       json NULL,
    mutation_id   varchar(255) NULL,
    rejected      boolean NOT NULL DEFAULT false,
    created_at    datetime(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    available_at  datetime(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    attempts      integer NOT NULL DEFAULT 0,
    last_error    text NULL,
    locked_by     varchar(64) NULL,
    locked_until  datetime(6) NULL,
    delivered_at  datetime(6) NULL,
    dead_at       datetime(6) NULL,
    UNIQUE KEY `outbox_event_id` (event_id),
    KEY `outbox_pending` (delivered_at, dead_at, sequence_id)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4;


-- native_mysql retained, MySql: grants
GRANT SELECT, UPDATE ON `outbox` TO 'relay'@'%';
-- Operators (`dead purge`, `prune`) also need DELETE on `outbox`.


-- native_mysql retained, MySql: claim_select
SELECT (o.`sequence_id` + 0), CAST(o.`event_id` AS CHAR), CAST(o.`destination` AS CHAR), CAST(o.`partition_key` AS CHAR), CAST(o.`event_type` AS CHAR), o.`payload`, CAST(o.`headers` AS CHAR), CAST(o.`mutation_id` AS CHAR), CAST(CASE WHEN o.`rejected` THEN 1 ELSE 0 END AS SIGNED), CAST(o.`attempts` AS SIGNED), TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', o.`created_at`), NULL, NULL, NULL FROM `outbox` o WHERE :condition ORDER BY o.`sequence_id` LIMIT :n

-- native_mysql retained, MySql: claim_select locking
SELECT (o.`sequence_id` + 0), CAST(o.`event_id` AS CHAR), CAST(o.`destination` AS CHAR), CAST(o.`partition_key` AS CHAR), CAST(o.`event_type` AS CHAR), o.`payload`, CAST(o.`headers` AS CHAR), CAST(o.`mutation_id` AS CHAR), CAST(CASE WHEN o.`rejected` THEN 1 ELSE 0 END AS SIGNED), CAST(o.`attempts` AS SIGNED), TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', o.`created_at`), NULL, NULL, NULL FROM `outbox` o WHERE :condition ORDER BY o.`sequence_id` LIMIT :n FOR UPDATE SKIP LOCKED

-- native_mysql retained, MySql: claim_and_mark
WITH l AS (SELECT o.`sequence_id` AS id FROM `outbox` o WHERE :condition
                         ORDER BY o.`sequence_id` LIMIT :n FOR UPDATE SKIP LOCKED),
                  u AS (SELECT x.id, x.k, row_number() OVER () AS n
                          FROM (SELECT o.`sequence_id` AS id, coalesce(CAST(o.`partition_key` AS CHAR), CAST(o.`destination` AS CHAR)) AS k FROM `outbox` o WHERE :condition
                                 ORDER BY o.`sequence_id` LIMIT :n) x),
                  passed AS (SELECT k, min(n) AS n FROM u
                              WHERE NOT EXISTS (SELECT 1 FROM l WHERE l.id = u.id) GROUP BY k),
                  c AS (SELECT u.id, u.n FROM u JOIN l ON l.id = u.id
                          LEFT JOIN passed ON passed.k IS NOT DISTINCT FROM u.k
                         WHERE passed.n IS NULL OR u.n < passed.n)
             UPDATE `outbox` o SET `locked_by` = :node, `locked_until` = UTC_TIMESTAMP(6) + INTERVAL (:lease * 1000) MICROSECOND FROM c
              WHERE o.`sequence_id` = c.id AND :node IS NOT NULL AND :lease >= 0
             RETURNING (o.`sequence_id` + 0), CAST(o.`event_id` AS CHAR), CAST(o.`destination` AS CHAR), CAST(o.`partition_key` AS CHAR), CAST(o.`event_type` AS CHAR), o.`payload`, CAST(o.`headers` AS CHAR), CAST(o.`mutation_id` AS CHAR), CAST(CASE WHEN o.`rejected` THEN 1 ELSE 0 END AS SIGNED), CAST(o.`attempts` AS SIGNED), TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', o.`created_at`), NULL, NULL, NULL, c.n

-- native_mysql retained, MySql: claim_order_column
14

-- native_mysql retained, MySql: at_micros
FROM_UNIXTIME(:micros / 1000000)

-- native_mysql retained, MySql: destination_is
CAST(CAST(o.`destination` AS CHAR) AS BINARY) = CAST(:destination AS BINARY)

-- native_mysql retained, MySql: delivered_between
(o.`delivered_at` IS NOT NULL) AND o.`created_at` >= FROM_UNIXTIME(:since / 1000000) AND o.`created_at` < FROM_UNIXTIME(:until / 1000000)

-- native_mysql retained, MySql: delivered_before
(o.`delivered_at` IS NOT NULL) AND o.`delivered_at` < FROM_UNIXTIME(:before / 1000000)

-- native_mysql retained, MySql: dead_before
(o.`dead_at` IS NOT NULL) AND o.`dead_at` < FROM_UNIXTIME(:before / 1000000)

-- native_mysql retained, MySql: release_unheld
UPDATE `outbox` o SET o.`locked_by` = NULL, o.`locked_until` = NULL WHERE o.`locked_by` IS NOT NULL AND o.`locked_by` = :node AND :not_held

-- native_mysql retained, MySql: count
SELECT CAST(count(*) AS SIGNED) FROM `outbox` o WHERE :condition

-- native_mysql retained, MySql: pick
SELECT CAST(o.`sequence_id` AS CHAR) FROM `outbox` o WHERE :condition ORDER BY o.`sequence_id` LIMIT :n

-- native_mysql retained, MySql: delete
DELETE FROM `outbox` WHERE `sequence_id` IN (1, 2)

-- native_mysql retained, MySql: delete_dead_records
DELETE FROM `outbox_dead_letters` WHERE id IN (1, 2)

-- native_mysql retained, MySql: retry
UPDATE `outbox` o SET o.`locked_by` = NULL, o.`locked_until` = NULL, o.`attempts` = :attempts, o.`last_error` = :error, o.`available_at` = UTC_TIMESTAMP(6) + INTERVAL (:delay * 1000) MICROSECOND WHERE o.`sequence_id` = :id AND o.`locked_by` = :node AND :attempts >= 0 AND :error IS NOT NULL AND :delay >= 0

-- native_mysql retained, MySql: dead_letter
UPDATE `outbox` o SET o.`dead_at` = UTC_TIMESTAMP(6), o.`attempts` = :attempts, o.`last_error` = :error, o.`locked_by` = NULL, o.`locked_until` = NULL WHERE o.`sequence_id` = :id AND o.`locked_by` = :node AND :attempts >= 0 AND :error IS NOT NULL

-- native_mysql retained, MySql: columns_query
SELECT CAST(column_name AS CHAR), CAST(data_type AS CHAR) FROM information_schema.columns WHERE table_schema = DATABASE() AND table_name = :p1

-- native_mysql retained, MySql: column_length_query
SELECT CAST(character_maximum_length AS SIGNED), CAST(character_octet_length AS SIGNED) FROM information_schema.columns WHERE table_schema = DATABASE() AND table_name = :p2 AND column_name = :p3

-- native_mysql retained, MySql: unique_column_query
SELECT CAST(COUNT(*) AS SIGNED) FROM (SELECT index_name FROM information_schema.statistics WHERE table_schema = DATABASE() AND table_name = :p4 AND non_unique = 0 GROUP BY index_name HAVING COUNT(*) = 1 AND MAX(column_name) = :p5 AND MAX(sub_part) IS NULL) u

-- native_mysql retained, MySql: insert
INSERT INTO `outbox` (`sequence_id`, `destination`, `event_id`) VALUES (?, ?, UUID())

-- native_mysql retained, MySql: not_in_ids
o.`sequence_id` NOT IN (1, 2)

-- native_mysql retained, MySql: not_in_texts
CAST(coalesce(CAST(o.`partition_key` AS CHAR), CAST(o.`destination` AS CHAR)) AS BINARY) NOT IN (CAST(:p6 AS BINARY), CAST(:p7 AS BINARY))

