-- public.outbox: ack_delete (row lease)
DELETE FROM "public"."outbox" o WHERE o.sequence_id = ANY($2) AND (o.event_id IN (SELECT unnest($3::uuid[])) OR o.sequence_id = ANY($4::int8[])) AND o.locked_by = $1 AND o.locked_until IS NOT NULL

-- public.outbox: ack_delete (partition fence)
DELETE FROM "public"."outbox" o WHERE o.sequence_id = ANY($2) AND (o.event_id IN (SELECT unnest($3::uuid[])) OR o.sequence_id = ANY($4::int8[])) AND (cardinality(CAST((SELECT coalesce(array_agg(pp.partition), '{}') FROM "public"."outbox_partitions" pp
                         JOIN unnest($5::int4[], $6::int8[]) AS h(partition, epoch) ON h.partition = pp.partition
                        WHERE pp.owner = $1 AND pp.epoch = h.epoch) AS int4[])) = $7 OR "public"."outbox_partition"(coalesce(o.partition_key, o.destination), $7) = ANY(CAST((SELECT coalesce(array_agg(pp.partition), '{}') FROM "public"."outbox_partitions" pp
                         JOIN unnest($5::int4[], $6::int8[]) AS h(partition, epoch) ON h.partition = pp.partition
                        WHERE pp.owner = $1 AND pp.epoch = h.epoch) AS int4[])))

-- public.outbox: ack_retain (row lease)
UPDATE "public"."outbox" o SET delivered_at = now(), locked_by = NULL, locked_until = NULL
                      WHERE o.sequence_id = ANY($2) AND (o.event_id IN (SELECT unnest($3::uuid[])) OR o.sequence_id = ANY($4::int8[])) AND o.locked_by = $1 AND o.locked_until IS NOT NULL

-- public.outbox: ack_retain (partition fence)
UPDATE "public"."outbox" o SET delivered_at = now(), locked_by = NULL, locked_until = NULL
                      WHERE o.sequence_id = ANY($2) AND (o.event_id IN (SELECT unnest($3::uuid[])) OR o.sequence_id = ANY($4::int8[])) AND (cardinality(CAST((SELECT coalesce(array_agg(pp.partition), '{}') FROM "public"."outbox_partitions" pp
                         JOIN unnest($5::int4[], $6::int8[]) AS h(partition, epoch) ON h.partition = pp.partition
                        WHERE pp.owner = $1 AND pp.epoch = h.epoch) AS int4[])) = $7 OR "public"."outbox_partition"(coalesce(o.partition_key, o.destination), $7) = ANY(CAST((SELECT coalesce(array_agg(pp.partition), '{}') FROM "public"."outbox_partitions" pp
                         JOIN unnest($5::int4[], $6::int8[]) AS h(partition, epoch) ON h.partition = pp.partition
                        WHERE pp.owner = $1 AND pp.epoch = h.epoch) AS int4[])))

-- public.outbox: retry_later (row lease)
UPDATE "public"."outbox" o
                        SET attempts = u.attempts, last_error = u.error,
                            available_at = now() + u.delay_ms * interval '1 millisecond',
                            locked_by = NULL, locked_until = NULL
                       FROM unnest($2::int8[], $3::int4[], $4::text[], $5::int8[], $6::uuid[])
                            AS u(sequence_id, attempts, error, delay_ms, event_id)
                      WHERE o.sequence_id = u.sequence_id AND (u.event_id IS NULL OR o.event_id = u.event_id) AND o.locked_by = $1 AND o.locked_until IS NOT NULL

-- public.outbox: retry_later (partition fence)
UPDATE "public"."outbox" o
                        SET attempts = u.attempts, last_error = u.error,
                            available_at = now() + u.delay_ms * interval '1 millisecond',
                            locked_by = NULL, locked_until = NULL
                       FROM unnest($2::int8[], $3::int4[], $4::text[], $5::int8[], $6::uuid[])
                            AS u(sequence_id, attempts, error, delay_ms, event_id)
                      WHERE o.sequence_id = u.sequence_id AND (u.event_id IS NULL OR o.event_id = u.event_id) AND (cardinality(CAST((SELECT coalesce(array_agg(pp.partition), '{}') FROM "public"."outbox_partitions" pp
                         JOIN unnest($7::int4[], $8::int8[]) AS h(partition, epoch) ON h.partition = pp.partition
                        WHERE pp.owner = $1 AND pp.epoch = h.epoch) AS int4[])) = $9 OR "public"."outbox_partition"(coalesce(o.partition_key, o.destination), $9) = ANY(CAST((SELECT coalesce(array_agg(pp.partition), '{}') FROM "public"."outbox_partitions" pp
                         JOIN unnest($7::int4[], $8::int8[]) AS h(partition, epoch) ON h.partition = pp.partition
                        WHERE pp.owner = $1 AND pp.epoch = h.epoch) AS int4[])))

-- public.outbox: dead_letter (row lease)
WITH moved AS (
                            DELETE FROM "public"."outbox" o
                             USING unnest($2::int8[], $3::int4[], $4::text[], $5::uuid[])
                                   AS u(sequence_id, attempts, error, event_id)
                             WHERE o.sequence_id = u.sequence_id AND (u.event_id IS NULL OR o.event_id = u.event_id) AND o.locked_by = $1 AND o.locked_until IS NOT NULL
                         RETURNING o.*, u.attempts AS final_attempts, u.error AS final_error)
                         INSERT INTO "public"."outbox_dead_letters" (sequence_id, event_id, destination, partition_key, event_type,
                                           payload, headers, mutation_id, rejected, created_at,
                                           attempts, last_error)
                         -- Undecodable rows too: a NULL where the dead letters allow none is
                         -- kept as an empty value (last_error says which it was).
                         SELECT sequence_id, coalesce(event_id, '00000000-0000-0000-0000-000000000000'),
                                coalesce(destination, ''), partition_key, coalesce(event_type, ''),
                                payload, coalesce(headers, '{}'), mutation_id, coalesce(rejected, false),
                                coalesce(created_at, now()), final_attempts, final_error
                           FROM moved

-- public.outbox: dead_letter (partition fence)
WITH moved AS (
                            DELETE FROM "public"."outbox" o
                             USING unnest($2::int8[], $3::int4[], $4::text[], $5::uuid[])
                                   AS u(sequence_id, attempts, error, event_id)
                             WHERE o.sequence_id = u.sequence_id AND (u.event_id IS NULL OR o.event_id = u.event_id) AND (cardinality(CAST((SELECT coalesce(array_agg(pp.partition), '{}') FROM "public"."outbox_partitions" pp
                         JOIN unnest($6::int4[], $7::int8[]) AS h(partition, epoch) ON h.partition = pp.partition
                        WHERE pp.owner = $1 AND pp.epoch = h.epoch) AS int4[])) = $8 OR "public"."outbox_partition"(coalesce(o.partition_key, o.destination), $8) = ANY(CAST((SELECT coalesce(array_agg(pp.partition), '{}') FROM "public"."outbox_partitions" pp
                         JOIN unnest($6::int4[], $7::int8[]) AS h(partition, epoch) ON h.partition = pp.partition
                        WHERE pp.owner = $1 AND pp.epoch = h.epoch) AS int4[])))
                         RETURNING o.*, u.attempts AS final_attempts, u.error AS final_error)
                         INSERT INTO "public"."outbox_dead_letters" (sequence_id, event_id, destination, partition_key, event_type,
                                           payload, headers, mutation_id, rejected, created_at,
                                           attempts, last_error)
                         -- Undecodable rows too: a NULL where the dead letters allow none is
                         -- kept as an empty value (last_error says which it was).
                         SELECT sequence_id, coalesce(event_id, '00000000-0000-0000-0000-000000000000'),
                                coalesce(destination, ''), partition_key, coalesce(event_type, ''),
                                payload, coalesce(headers, '{}'), mutation_id, coalesce(rejected, false),
                                coalesce(created_at, now()), final_attempts, final_error
                           FROM moved

-- public.outbox: claim
WITH locked AS (
                    SELECT o.sequence_id FROM "public"."outbox" o
                    WHERE o.delivered_at IS NULL
                      AND o.available_at <= now()
                      AND (o.locked_until IS NULL OR o.locked_until < now())
                       AND CASE WHEN NOT EXISTS (
                    SELECT 1 FROM "public"."outbox" p
                    WHERE hashtextextended(coalesce(p.partition_key, p.destination), 0) = hashtextextended(coalesce(o.partition_key, o.destination), 0) AND coalesce(p.partition_key, p.destination) = coalesce(o.partition_key, o.destination)
                      AND p.sequence_id < o.sequence_id
                      AND p.delivered_at IS NULL
                      AND (p.locked_by IS NOT NULL OR p.attempts > 0)
                      AND (p.available_at > now() OR (p.locked_until > now() AND p.locked_by <> $1))) THEN pg_try_advisory_xact_lock(hashtext('"public"."outbox"'), hashtext(coalesce(o.partition_key, o.destination))) ELSE false END
                    ORDER BY o.sequence_id
                    LIMIT $2
                    FOR UPDATE SKIP LOCKED),
                  passed AS (
                    SELECT coalesce(o.partition_key, o.destination) AS k, min(o.sequence_id) AS first
                    FROM "public"."outbox" o
                    WHERE o.delivered_at IS NULL
                      AND o.available_at <= now()
                      AND (o.locked_until IS NULL OR o.locked_until < now())
                      AND o.sequence_id < (SELECT max(sequence_id) FROM locked)
                      AND o.sequence_id NOT IN (SELECT sequence_id FROM locked)
                    GROUP BY 1),
                  claimable AS (
                    SELECT o.sequence_id FROM "public"."outbox" o JOIN locked l ON l.sequence_id = o.sequence_id
                    WHERE NOT EXISTS (
                    SELECT 1 FROM "public"."outbox" p
                    WHERE hashtextextended(coalesce(p.partition_key, p.destination), 0) = hashtextextended(coalesce(o.partition_key, o.destination), 0) AND coalesce(p.partition_key, p.destination) = coalesce(o.partition_key, o.destination)
                      AND p.sequence_id < o.sequence_id
                      AND p.delivered_at IS NULL
                      AND (p.locked_by IS NOT NULL OR p.attempts > 0)
                      AND ((p.locked_by IS DISTINCT FROM $1 OR p.locked_until IS NULL OR p.locked_until <= now())
                          AND p.sequence_id NOT IN (SELECT sequence_id FROM locked))) AND NOT EXISTS (SELECT 1 FROM passed WHERE passed.k = coalesce(o.partition_key, o.destination) AND passed.first < o.sequence_id))
                 UPDATE "public"."outbox" o
                    SET locked_by = $1, locked_until = now() + $3::int8 * interval '1 millisecond'
                   FROM claimable c
                  WHERE o.sequence_id = c.sequence_id
              RETURNING o.sequence_id, o.event_id, o.destination, o.partition_key, o.event_type, o.payload::text, o.headers::text, o.mutation_id, o.rejected, o.attempts, o.created_at

-- public.outbox: claim_owned
SELECT o.sequence_id, o.event_id, o.destination, o.partition_key, o.event_type, o.payload::text, o.headers::text, o.mutation_id, o.rejected, o.attempts, o.created_at FROM "public"."outbox" o
                  WHERE o.delivered_at IS NULL
                    AND o.available_at <= now()
                    AND o.sequence_id NOT IN (SELECT unnest($3::int8[]))
                    AND (cardinality(CAST((SELECT coalesce(array_agg(pp.partition), '{}') FROM "public"."outbox_partitions" pp
                     JOIN unnest($5::int4[], $6::int8[]) AS h(partition, epoch) ON h.partition = pp.partition
                    WHERE pp.owner = $1 AND pp.epoch = h.epoch AND pp.lease_until > now()) AS int4[])) = $4 OR "public"."outbox_partition"(coalesce(o.partition_key, o.destination), $4) = ANY(CAST((SELECT coalesce(array_agg(pp.partition), '{}') FROM "public"."outbox_partitions" pp
                     JOIN unnest($5::int4[], $6::int8[]) AS h(partition, epoch) ON h.partition = pp.partition
                    WHERE pp.owner = $1 AND pp.epoch = h.epoch AND pp.lease_until > now()) AS int4[])))
                    AND NOT EXISTS (
                    SELECT 1 FROM "public"."outbox" p
                    WHERE hashtextextended(coalesce(p.partition_key, p.destination), 0) = hashtextextended(coalesce(o.partition_key, o.destination), 0) AND coalesce(p.partition_key, p.destination) = coalesce(o.partition_key, o.destination)
                      AND p.sequence_id < o.sequence_id
                      AND p.delivered_at IS NULL
                      AND (p.locked_by IS NOT NULL OR p.attempts > 0)
                      AND (p.attempts > 0 AND p.available_at > now()))
                    AND $1::text IS NOT NULL
                    AND o.sequence_id >= $7
                    AND ($7 = '-9223372036854775808'::int8 OR $8::int8 IS NULL OR now() < to_timestamp($8::int8 / 1000000.0))
                    
                  ORDER BY o.sequence_id
                  LIMIT $2

-- public.outbox: claim_crowded
WITH locked AS (
                    SELECT o.sequence_id FROM "public"."outbox" o
                    WHERE o.delivered_at IS NULL
                      AND o.available_at <= now()
                      AND (o.locked_until IS NULL OR o.locked_until < now())
                      AND NOT (coalesce(o.partition_key, o.destination) = ANY($4::text[]))
                      AND o.sequence_id <= (SELECT coalesce(max(b.sequence_id), 0) FROM (
                            SELECT w.sequence_id FROM "public"."outbox" w
                             WHERE w.delivered_at IS NULL AND w.available_at <= now() AND (w.locked_until IS NULL OR w.locked_until < now())
                             ORDER BY w.sequence_id LIMIT $5) b) AND CASE WHEN NOT EXISTS (
                    SELECT 1 FROM "public"."outbox" p
                    WHERE hashtextextended(coalesce(p.partition_key, p.destination), 0) = hashtextextended(coalesce(o.partition_key, o.destination), 0) AND coalesce(p.partition_key, p.destination) = coalesce(o.partition_key, o.destination)
                      AND p.sequence_id < o.sequence_id
                      AND p.delivered_at IS NULL
                      AND (p.locked_by IS NOT NULL OR p.attempts > 0)
                      AND (p.available_at > now() OR (p.locked_until > now() AND p.locked_by <> $1))) THEN pg_try_advisory_xact_lock(hashtext('"public"."outbox"'), hashtext(coalesce(o.partition_key, o.destination))) ELSE false END
                    ORDER BY o.sequence_id
                    LIMIT $2
                    FOR UPDATE SKIP LOCKED),
                  passed AS (
                    SELECT coalesce(o.partition_key, o.destination) AS k, min(o.sequence_id) AS first
                    FROM "public"."outbox" o
                    WHERE o.delivered_at IS NULL
                      AND o.available_at <= now()
                      AND (o.locked_until IS NULL OR o.locked_until < now())
                      AND o.sequence_id < (SELECT max(sequence_id) FROM locked)
                      AND o.sequence_id NOT IN (SELECT sequence_id FROM locked)
                    GROUP BY 1),
                  claimable AS (
                    SELECT o.sequence_id FROM "public"."outbox" o JOIN locked l ON l.sequence_id = o.sequence_id
                    WHERE NOT EXISTS (
                    SELECT 1 FROM "public"."outbox" p
                    WHERE hashtextextended(coalesce(p.partition_key, p.destination), 0) = hashtextextended(coalesce(o.partition_key, o.destination), 0) AND coalesce(p.partition_key, p.destination) = coalesce(o.partition_key, o.destination)
                      AND p.sequence_id < o.sequence_id
                      AND p.delivered_at IS NULL
                      AND (p.locked_by IS NOT NULL OR p.attempts > 0)
                      AND ((p.locked_by IS DISTINCT FROM $1 OR p.locked_until IS NULL OR p.locked_until <= now())
                          AND p.sequence_id NOT IN (SELECT sequence_id FROM locked))) AND NOT EXISTS (SELECT 1 FROM passed WHERE passed.k = coalesce(o.partition_key, o.destination) AND passed.first < o.sequence_id))
                 UPDATE "public"."outbox" o
                    SET locked_by = $1, locked_until = now() + $3::int8 * interval '1 millisecond'
                   FROM claimable c
                  WHERE o.sequence_id = c.sequence_id
              RETURNING o.sequence_id, o.event_id, o.destination, o.partition_key, o.event_type, o.payload::text, o.headers::text, o.mutation_id, o.rejected, o.attempts, o.created_at

-- public.outbox: claim_owned_crowded
SELECT o.sequence_id, o.event_id, o.destination, o.partition_key, o.event_type, o.payload::text, o.headers::text, o.mutation_id, o.rejected, o.attempts, o.created_at FROM "public"."outbox" o
                  WHERE o.delivered_at IS NULL
                    AND o.available_at <= now()
                    AND o.sequence_id NOT IN (SELECT unnest($3::int8[]))
                    AND (cardinality(CAST((SELECT coalesce(array_agg(pp.partition), '{}') FROM "public"."outbox_partitions" pp
                     JOIN unnest($5::int4[], $6::int8[]) AS h(partition, epoch) ON h.partition = pp.partition
                    WHERE pp.owner = $1 AND pp.epoch = h.epoch AND pp.lease_until > now()) AS int4[])) = $4 OR "public"."outbox_partition"(coalesce(o.partition_key, o.destination), $4) = ANY(CAST((SELECT coalesce(array_agg(pp.partition), '{}') FROM "public"."outbox_partitions" pp
                     JOIN unnest($5::int4[], $6::int8[]) AS h(partition, epoch) ON h.partition = pp.partition
                    WHERE pp.owner = $1 AND pp.epoch = h.epoch AND pp.lease_until > now()) AS int4[])))
                    AND NOT EXISTS (
                    SELECT 1 FROM "public"."outbox" p
                    WHERE hashtextextended(coalesce(p.partition_key, p.destination), 0) = hashtextextended(coalesce(o.partition_key, o.destination), 0) AND coalesce(p.partition_key, p.destination) = coalesce(o.partition_key, o.destination)
                      AND p.sequence_id < o.sequence_id
                      AND p.delivered_at IS NULL
                      AND (p.locked_by IS NOT NULL OR p.attempts > 0)
                      AND (p.attempts > 0 AND p.available_at > now()))
                    AND $1::text IS NOT NULL
                    AND o.sequence_id >= $7
                    AND ($7 = '-9223372036854775808'::int8 OR $8::int8 IS NULL OR now() < to_timestamp($8::int8 / 1000000.0))
                    AND NOT (coalesce(o.partition_key, o.destination) = ANY($9::text[]))
                      AND o.sequence_id <= (SELECT coalesce(max(b.sequence_id), 0) FROM (
                            SELECT w.sequence_id FROM "public"."outbox" w
                             WHERE w.delivered_at IS NULL AND w.available_at <= now() AND w.sequence_id NOT IN (SELECT unnest($3::int8[]))
               AND (cardinality(CAST((SELECT coalesce(array_agg(pp.partition), '{}') FROM "public"."outbox_partitions" pp
                     JOIN unnest($5::int4[], $6::int8[]) AS h(partition, epoch) ON h.partition = pp.partition
                    WHERE pp.owner = $1 AND pp.epoch = h.epoch AND pp.lease_until > now()) AS int4[])) = $4
                    OR "public"."outbox_partition"(coalesce(w.partition_key, w.destination), $4) = ANY(CAST((SELECT coalesce(array_agg(pp.partition), '{}') FROM "public"."outbox_partitions" pp
                     JOIN unnest($5::int4[], $6::int8[]) AS h(partition, epoch) ON h.partition = pp.partition
                    WHERE pp.owner = $1 AND pp.epoch = h.epoch AND pp.lease_until > now()) AS int4[])))
                             ORDER BY w.sequence_id LIMIT $10) b)
                  ORDER BY o.sequence_id
                  LIMIT $2

-- public.outbox: floor_sequence
SELECT coalesce(pg_sequence_last_value(q.s), 0)::int8, q.s IS NOT NULL,
                        (SELECT seqcache FROM pg_catalog.pg_sequence WHERE seqrelid = q.s)::int8,
                        (SELECT seqincrement FROM pg_catalog.pg_sequence WHERE seqrelid = q.s)::int8,
                        to_regclass('"public"."outbox_scheduled_idx"') IS NOT NULL
                   FROM (SELECT pg_get_serial_sequence('"public"."outbox"', 'sequence_id')::regclass AS s) q

-- public.outbox: floor_writers
SELECT coalesce(array_agg(l.virtualtransaction), '{}') FROM pg_catalog.pg_locks l
                  WHERE l.locktype = 'relation'
                    AND l.relation IN ('"public"."outbox"'::regclass, pg_get_serial_sequence('"public"."outbox"', 'sequence_id')::regclass)
                    AND l.database = (SELECT oid FROM pg_catalog.pg_database WHERE datname = current_database())
                    AND l.mode IN ('RowExclusiveLock', 'ShareRowExclusiveLock', 'ExclusiveLock', 'AccessExclusiveLock')

-- public.outbox: floor_due
SELECT CASE WHEN isfinite(m) THEN (extract(epoch from m) * 1000000)::int8 END
                   FROM (SELECT min(o.available_at) AS m FROM "public"."outbox" o
                          WHERE o.delivered_at IS NULL AND o.available_at > o.created_at
                            AND o.available_at > now()
                            AND (cardinality($2::int4[]) = $3 OR "public"."outbox_partition"(coalesce(o.partition_key, o.destination), $3) = ANY($2::int4[]))
                            AND $1::text IS NOT NULL) d

-- public.outbox: floor_after
SELECT (SELECT count(*) FROM "public"."outbox_partitions" pp
                           JOIN unnest($2::int4[], $3::int8[]) AS h(partition, epoch) ON h.partition = pp.partition
                          WHERE pp.owner = $1 AND pp.epoch = h.epoch AND pp.lease_until > now())
                        = cardinality($2::int4[]),
                        coalesce(now() >= to_timestamp($4::int8 / 1000000.0), false)

-- public.outbox: claim_unordered
WITH locked AS (
                    SELECT o.sequence_id FROM "public"."outbox" o
                    WHERE o.delivered_at IS NULL
                      AND o.available_at <= now()
                      AND (o.locked_until IS NULL OR o.locked_until < now())
                      
                    ORDER BY o.sequence_id
                    LIMIT $2
                    FOR UPDATE SKIP LOCKED),
                  passed AS (
                    SELECT coalesce(o.partition_key, o.destination) AS k, min(o.sequence_id) AS first
                    FROM "public"."outbox" o
                    WHERE o.delivered_at IS NULL
                      AND o.available_at <= now()
                      AND (o.locked_until IS NULL OR o.locked_until < now())
                      AND o.sequence_id < (SELECT max(sequence_id) FROM locked)
                      AND o.sequence_id NOT IN (SELECT sequence_id FROM locked)
                    GROUP BY 1),
                  claimable AS (
                    SELECT o.sequence_id FROM "public"."outbox" o JOIN locked l ON l.sequence_id = o.sequence_id
                    WHERE true)
                 UPDATE "public"."outbox" o
                    SET locked_by = $1, locked_until = now() + $3::int8 * interval '1 millisecond'
                   FROM claimable c
                  WHERE o.sequence_id = c.sequence_id
              RETURNING o.sequence_id, o.event_id, o.destination, o.partition_key, o.event_type, o.payload::text, o.headers::text, o.mutation_id, o.rejected, o.attempts, o.created_at

-- public.outbox: release
UPDATE "public"."outbox" SET locked_until = NULL
                  WHERE sequence_id = ANY($2) AND locked_by = $1 AND locked_until IS NOT NULL

-- public.outbox: release_unheld
UPDATE "public"."outbox" SET locked_until = NULL
                  WHERE locked_by = $1 AND locked_until IS NOT NULL AND delivered_at IS NULL
                    AND sequence_id NOT IN (SELECT unnest($2::int8[]))

-- public.outbox: extend_leases
UPDATE "public"."outbox" SET locked_until = now() + $3::int8 * interval '1 millisecond'
                  WHERE sequence_id = ANY($2) AND locked_by = $1 AND locked_until IS NOT NULL

-- public.outbox: backlog
SELECT count(*)::int8,
                        count(*) FILTER (WHERE attempts > 0)::int8,
                        (extract(epoch from now() - min(CASE
        WHEN attempts > 0 THEN created_at
        WHEN available_at <= now() THEN greatest(created_at, available_at)
    END) FILTER (WHERE isfinite(created_at))) * 1000)::int8
                   FROM "public"."outbox" WHERE delivered_at IS NULL

-- public.outbox: dead_count
SELECT count(*)::int8 FROM "public"."outbox_dead_letters"

-- public.outbox: insert
INSERT INTO "public"."outbox" (event_id, destination, partition_key, event_type, payload,
                                  headers, mutation_id)
                 SELECT coalesce(u.event_id, gen_random_uuid()), u.destination, u.partition_key,
                        u.event_type, u.payload::jsonb, u.headers::jsonb, u.mutation_id
                   FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::text[],
                               $6::text[], $7::text[])
                        WITH ORDINALITY AS u(event_id, destination, partition_key, event_type,
                                             payload, headers, mutation_id, n)
                  ORDER BY u.n
              RETURNING sequence_id

-- public.outbox: heartbeat
WITH pushed AS (
                    UPDATE "public"."outbox_nodes"
                       SET expiry = (now() AT TIME ZONE 'UTC') + $2::int8 * interval '1 millisecond'
                     WHERE id = $1
                       AND expiry = 'epoch'::timestamp + $3::int8 * interval '1 microsecond'
                 RETURNING expiry
                 ), inserted AS (
                    INSERT INTO "public"."outbox_nodes" (id, expiry, partitions_table, relays_outbox, claims, partition_count)
                    SELECT $1, (now() AT TIME ZONE 'UTC') + $2::int8 * interval '1 millisecond', '', NULL, NULL, NULL
                     WHERE NOT EXISTS (SELECT 1 FROM pushed)
                        ON CONFLICT (id) DO NOTHING
                 RETURNING expiry
                 )
                 SELECT (extract(epoch from expiry) * 1000000)::int8, true FROM pushed
                 UNION ALL
                 SELECT (extract(epoch from expiry) * 1000000)::int8, true FROM inserted
                 UNION ALL
                 SELECT (extract(epoch from expiry) * 1000000)::int8, false FROM "public"."outbox_nodes"
                  WHERE id = $1
                    AND NOT EXISTS (SELECT 1 FROM pushed)
                    AND NOT EXISTS (SELECT 1 FROM inserted)

-- public.outbox: remove_expired
DELETE FROM "public"."outbox_nodes" WHERE expiry < (now() AT TIME ZONE 'UTC')

-- public.outbox: deregister
DELETE FROM "public"."outbox_nodes"
                  WHERE id = $1 AND expiry = 'epoch'::timestamp + $2::int8 * interval '1 microsecond'

-- public.outbox: live_nodes
SELECT id, (extract(epoch from expiry) * 1000000)::int8 FROM "public"."outbox_nodes"
                  WHERE expiry >= (now() AT TIME ZONE 'UTC') ORDER BY id

-- public.outbox: nodes_behind
WITH announced AS (
                    UPDATE "public"."outbox_nodes" SET protocol = $2, partitions_table = '"public"."outbox_partitions"'
                     WHERE id = $1
                       AND (protocol IS DISTINCT FROM $2 OR partitions_table IS DISTINCT FROM '"public"."outbox_partitions"')
                 RETURNING id
                 )
                 SELECT id, coalesce(protocol, 1) FROM "public"."outbox_nodes"
                  WHERE id <> $1 AND expiry >= (now() AT TIME ZONE 'UTC')
                    AND coalesce(protocol, 1) < $3
                  ORDER BY id

-- public.outbox: partition_peers
SELECT id FROM "public"."outbox_nodes"
                  WHERE expiry >= (now() AT TIME ZONE 'UTC')
                    AND (partitions_table IS NULL OR partitions_table = '"public"."outbox_partitions"')
                  ORDER BY id

-- public.outbox: partition_count
SELECT count(*)::int8, (SELECT pg_encoding_to_char(encoding)::text FROM pg_database WHERE datname = current_database()),
              CASE WHEN count(*) > 0 AND (min(partition) <> 0 OR max(partition) <> count(*) - 1)
                   THEN (SELECT string_agg(n::text, ', ' ORDER BY n)
                           FROM generate_series(0, (SELECT max(partition) FROM "public"."outbox_partitions")) n
                          WHERE NOT EXISTS (SELECT FROM "public"."outbox_partitions" p WHERE p.partition = n)) END
              FROM "public"."outbox_partitions"

-- public.outbox: claim_mode_peers
WITH announced AS (
                    UPDATE "public"."outbox_nodes"
                       SET partitions_table = CASE WHEN $2 = 'ordered' THEN '"public"."outbox_partitions"' ELSE '' END, relays_outbox = '"public"."outbox"', claims = $2,
                           partition_count = $4
                     WHERE id = $1 AND $3
                       AND (partitions_table IS DISTINCT FROM CASE WHEN $2 = 'ordered' THEN '"public"."outbox_partitions"' ELSE '' END
                            OR relays_outbox IS DISTINCT FROM '"public"."outbox"'
                            OR claims IS DISTINCT FROM $2
                            OR partition_count IS DISTINCT FROM $4)
                 RETURNING id
                 )
                 SELECT id, claims, partition_count FROM "public"."outbox_nodes"
                  WHERE id <> $1 AND expiry >= (now() AT TIME ZONE 'UTC')
                    AND (relays_outbox = '"public"."outbox"' AND claims <> $2
                         OR claims IS NULL AND $2 <> 'ordered' AND partitions_table = '"public"."outbox_partitions"'
                         OR relays_outbox = '"public"."outbox"' AND claims = $2
                            AND partition_count <> $4)
                  ORDER BY id

-- public.outbox: acquire
UPDATE "public"."outbox_partitions"
                    SET owner = $1, epoch = epoch + 1,
                        lease_until = now() + $3::int8 * interval '1 millisecond'
                  WHERE partition = ANY($2::int4[])
                    AND (owner IS NULL OR owner = $1 OR lease_until IS NULL OR lease_until < now())
              RETURNING partition, epoch

-- public.outbox: renew
UPDATE "public"."outbox_partitions" p SET lease_until = now() + $4::int8 * interval '1 millisecond'
                   FROM unnest($2::int4[], $3::int8[]) AS h(partition, epoch)
                  WHERE p.partition = h.partition AND p.owner = $1 AND p.epoch = h.epoch
                    AND p.lease_until > now()
              RETURNING p.partition

-- public.outbox: release_partitions
UPDATE "public"."outbox_partitions" SET owner = NULL, lease_until = NULL
                  WHERE partition = ANY($2::int4[]) AND owner = $1

-- public.outbox: partitions
SELECT partition, owner, epoch, (extract(epoch from lease_until) * 1000000)::int8
                   FROM "public"."outbox_partitions" ORDER BY partition

-- public.outbox: register
WITH taken AS (
                    INSERT INTO "public"."outbox_nodes" (id, expiry, partitions_table, relays_outbox, claims, partition_count)
                    VALUES ($1, (now() AT TIME ZONE 'UTC') + $2::int8 * interval '1 millisecond', '', NULL, NULL, NULL)
                        ON CONFLICT (id) DO UPDATE SET expiry = EXCLUDED.expiry, partitions_table = EXCLUDED.partitions_table, relays_outbox = NULL, claims = NULL, partition_count = NULL
                     WHERE "public"."outbox_nodes".expiry < (now() AT TIME ZONE 'UTC')
                 RETURNING expiry
                 )
                 SELECT true, (extract(epoch from expiry) * 1000000)::int8 FROM taken
                 UNION ALL
                 SELECT false, (extract(epoch from expiry) * 1000000)::int8 FROM "public"."outbox_nodes"
                  WHERE id = $1 AND NOT EXISTS (SELECT 1 FROM taken)

-- public.outbox: dead_retry (ids)
WITH chosen AS (
                        SELECT sequence_id, EXISTS (SELECT 1 FROM "public"."outbox" o
                                                     WHERE o.event_id = d.event_id
                                                        OR o.sequence_id = d.sequence_id) AS taken
                          FROM "public"."outbox_dead_letters" d WHERE sequence_id = ANY($1::int8[])),
                 moved AS (DELETE FROM "public"."outbox_dead_letters"
                            WHERE sequence_id IN (SELECT sequence_id FROM chosen WHERE NOT taken)
                        RETURNING *),
                 inserted AS (
                     INSERT INTO "public"."outbox" (sequence_id, event_id, destination, partition_key, event_type,
                                      payload, headers, mutation_id, rejected, created_at)
                     SELECT sequence_id, event_id, destination, partition_key, event_type,
                            payload, headers, mutation_id, rejected, created_at FROM moved
                     RETURNING 1)
                 SELECT (SELECT count(*) FROM inserted)::int8,
                        (SELECT count(*) FROM chosen WHERE taken)::int8

-- public.outbox: dead_retry (destination)
WITH chosen AS (
                        SELECT sequence_id, EXISTS (SELECT 1 FROM "public"."outbox" o
                                                     WHERE o.event_id = d.event_id
                                                        OR o.sequence_id = d.sequence_id) AS taken
                          FROM "public"."outbox_dead_letters" d WHERE destination = $1),
                 moved AS (DELETE FROM "public"."outbox_dead_letters"
                            WHERE sequence_id IN (SELECT sequence_id FROM chosen WHERE NOT taken)
                        RETURNING *),
                 inserted AS (
                     INSERT INTO "public"."outbox" (sequence_id, event_id, destination, partition_key, event_type,
                                      payload, headers, mutation_id, rejected, created_at)
                     SELECT sequence_id, event_id, destination, partition_key, event_type,
                            payload, headers, mutation_id, rejected, created_at FROM moved
                     RETURNING 1)
                 SELECT (SELECT count(*) FROM inserted)::int8,
                        (SELECT count(*) FROM chosen WHERE taken)::int8

-- public.outbox: dead_retry (all)
WITH chosen AS (
                        SELECT sequence_id, EXISTS (SELECT 1 FROM "public"."outbox" o
                                                     WHERE o.event_id = d.event_id
                                                        OR o.sequence_id = d.sequence_id) AS taken
                          FROM "public"."outbox_dead_letters" d WHERE $1::bool),
                 moved AS (DELETE FROM "public"."outbox_dead_letters"
                            WHERE sequence_id IN (SELECT sequence_id FROM chosen WHERE NOT taken)
                        RETURNING *),
                 inserted AS (
                     INSERT INTO "public"."outbox" (sequence_id, event_id, destination, partition_key, event_type,
                                      payload, headers, mutation_id, rejected, created_at)
                     SELECT sequence_id, event_id, destination, partition_key, event_type,
                            payload, headers, mutation_id, rejected, created_at FROM moved
                     RETURNING 1)
                 SELECT (SELECT count(*) FROM inserted)::int8,
                        (SELECT count(*) FROM chosen WHERE taken)::int8

-- public.outbox: dead_purge (ids)
DELETE FROM "public"."outbox_dead_letters" WHERE sequence_id = ANY($1::int8[])

-- public.outbox: dead_purge (destination)
DELETE FROM "public"."outbox_dead_letters" WHERE destination = $1

-- public.outbox: dead_purge (all)
DELETE FROM "public"."outbox_dead_letters" WHERE $1::bool

-- public.outbox: stats_pending
SELECT destination, count(*)::int8, count(*) FILTER (WHERE attempts > 0)::int8,
                            (extract(epoch from now() - min(CASE
        WHEN attempts > 0 THEN created_at
        WHEN available_at <= now() THEN greatest(created_at, available_at)
    END) FILTER (WHERE isfinite(created_at))) * 1000)::int8
                       FROM "public"."outbox" WHERE delivered_at IS NULL GROUP BY destination

-- public.outbox: stats_dead
SELECT destination, count(*)::int8 FROM "public"."outbox_dead_letters" GROUP BY destination

-- public.outbox: dead_list
SELECT sequence_id, event_id, destination, event_type, attempts::int8, last_error,
                            (extract(epoch from dead_at) * 1000000)::int8
                       FROM "public"."outbox_dead_letters"
                      WHERE ($1::text IS NULL OR destination = $1)
                        AND ($2::text IS NULL OR event_type = $2) AND sequence_id > $3
                      ORDER BY sequence_id LIMIT $4

-- public.outbox: event
SELECT sequence_id, event_id, destination, event_type, partition_key,
                            payload::text, headers::text, attempts::int8, last_error, CASE WHEN isfinite(created_at) THEN (extract(epoch from created_at) * 1000000)::int8 END,
                            delivered_at IS NOT NULL, false, NULL::int8
                       FROM "public"."outbox" WHERE sequence_id = $1
                     UNION ALL
                     SELECT sequence_id, event_id, destination, event_type, partition_key,
                            payload::text, headers::text, attempts::int8, last_error, CASE WHEN isfinite(created_at) THEN (extract(epoch from created_at) * 1000000)::int8 END,
                            false, true, CASE WHEN isfinite(dead_at) THEN (extract(epoch from dead_at) * 1000000)::int8 END
                       FROM "public"."outbox_dead_letters" WHERE sequence_id = $1

-- public.outbox: count_replayable
SELECT count(*)::int8 FROM "public"."outbox"
                      WHERE delivered_at IS NOT NULL AND created_at >= to_timestamp($1)
                        AND created_at < to_timestamp($2) AND ($3::text IS NULL OR destination = $3)

-- public.outbox: replay_batch
WITH b AS (
                        SELECT sequence_id FROM "public"."outbox"
                         WHERE delivered_at IS NOT NULL AND created_at >= to_timestamp($1)
                           AND created_at < to_timestamp($2) AND ($3::text IS NULL OR destination = $3)
                           AND sequence_id > $4
                         ORDER BY sequence_id LIMIT $5 FOR UPDATE)
                     UPDATE "public"."outbox" o SET delivered_at = NULL, attempts = 0, last_error = NULL,
                            available_at = now(), locked_by = NULL, locked_until = NULL
                       FROM b WHERE o.sequence_id = b.sequence_id
                     RETURNING o.sequence_id

-- public.outbox: wake_relays
SELECT pg_notify($1, '')

-- public.outbox: count_delivered_before
SELECT count(*)::int8 FROM "public"."outbox" WHERE delivered_at < to_timestamp($1)

-- public.outbox: count_dead_before
SELECT count(*)::int8 FROM "public"."outbox_dead_letters" WHERE dead_at < to_timestamp($1)

-- public.outbox: prune_delivered
DELETE FROM "public"."outbox" WHERE sequence_id IN (
                SELECT sequence_id FROM "public"."outbox" WHERE delivered_at < to_timestamp($1)
                 ORDER BY sequence_id LIMIT $2 FOR UPDATE SKIP LOCKED)

-- public.outbox: prune_dead
DELETE FROM "public"."outbox_dead_letters" WHERE sequence_id IN (
                SELECT sequence_id FROM "public"."outbox_dead_letters" WHERE dead_at < to_timestamp($1)
                 ORDER BY sequence_id LIMIT $2 FOR UPDATE SKIP LOCKED)

-- public.outbox: ddl
-- The schema's version per component, advanced after each step (see README, Upgrading).
DO $create_schema$ BEGIN IF to_regnamespace('"public"') IS NULL THEN CREATE SCHEMA "public"; END IF; END $create_schema$;
CREATE TABLE IF NOT EXISTS "public"."outbox_versions" (
    component     text PRIMARY KEY,
    version       integer NOT NULL,
    readable_from integer NOT NULL, -- the oldest schema version a relay must know to run on it
    migrated_at   timestamptz NOT NULL DEFAULT now()
);

-- outbox schema step 1: the outbox, dead-letter, partitions and nodes tables and the partition function, where missing (existing tables are not touched) (online).
DO $create_schema$ BEGIN IF to_regnamespace('"public"') IS NULL THEN CREATE SCHEMA "public"; END IF; END $create_schema$;
DO $create_schema$ BEGIN IF to_regnamespace('"public"') IS NULL THEN CREATE SCHEMA "public"; END IF; END $create_schema$;

-- Applications insert here, in the same transaction as their data change.
CREATE TABLE IF NOT EXISTS "public"."outbox" (
    sequence_id   bigserial PRIMARY KEY,          -- publish order
    event_id      uuid NOT NULL UNIQUE DEFAULT gen_random_uuid(), -- idempotency key sent to brokers
    destination   text NOT NULL,                  -- channel, topic or subject
    partition_key text,                           -- ordering key; NULL means the destination
    event_type    text NOT NULL,                  -- message name
    payload       jsonb,
    headers       jsonb NOT NULL DEFAULT '{}',
    mutation_id   text,
    rejected      boolean NOT NULL DEFAULT false,
    created_at    timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- relay bookkeeping: applications leave these alone (available_at may schedule delivery)
    available_at  timestamptz NOT NULL DEFAULT now(),
    attempts      integer NOT NULL DEFAULT 0,
    last_error    text,
    locked_by     text,
    locked_until  timestamptz,
    delivered_at  timestamptz                     -- set only with --retain-delivered
);

-- Events that can never be delivered, whole, with their attempts and last error.
CREATE TABLE IF NOT EXISTS "public"."outbox_dead_letters" (
    sequence_id   bigint PRIMARY KEY,
    event_id      uuid NOT NULL,
    destination   text NOT NULL,
    partition_key text,
    event_type    text NOT NULL,
    payload       jsonb,
    headers       jsonb NOT NULL DEFAULT '{}',
    mutation_id   text,
    rejected      boolean NOT NULL DEFAULT false,
    created_at    timestamptz NOT NULL,
    attempts      integer NOT NULL,
    last_error    text NOT NULL,
    dead_at       timestamptz NOT NULL DEFAULT now()
);

-- A key's partition: the first 4 bytes of md5(key), sign bit cleared, modulo the count.
CREATE OR REPLACE FUNCTION "public"."outbox_partition"(key text, partitions integer) RETURNS integer
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    AS $$ SELECT ((('x' || substr(md5(key), 1, 8))::bit(32)::integer) & 2147483647) % partitions $$;

-- Partition leases: one owner at a time, a fencing epoch that grows with every takeover.
CREATE TABLE IF NOT EXISTS "public"."outbox_partitions" (
    partition   integer PRIMARY KEY,
    owner       text,
    epoch       bigint NOT NULL DEFAULT 0,
    lease_until timestamptz
);
INSERT INTO "public"."outbox_partitions" (partition)
    SELECT generate_series(0, 64 - 1)
    WHERE NOT EXISTS (SELECT 1 FROM "public"."outbox_partitions");

-- Relay nodes and their heartbeats (the Ably connector's nodes table).
CREATE TABLE IF NOT EXISTS "public"."outbox_nodes" (
    id     text PRIMARY KEY,
    expiry timestamp without time zone NOT NULL
);
INSERT INTO "public"."outbox_versions" (component, version, readable_from) VALUES ('outbox', 1, 1)
    ON CONFLICT (component) DO UPDATE SET version = EXCLUDED.version,
        readable_from = EXCLUDED.readable_from, migrated_at = now();

-- outbox schema step 2: the pending rows' index (the claim scan) (online). Run each statement outside a transaction.
CREATE INDEX CONCURRENTLY IF NOT EXISTS "outbox_pending_idx" ON "public"."outbox" (sequence_id) WHERE delivered_at IS NULL;
-- (interrupted? an index it left INVALID must be dropped with DROP INDEX CONCURRENTLY first)
INSERT INTO "public"."outbox_versions" (component, version, readable_from) VALUES ('outbox', 2, 1)
    ON CONFLICT (component) DO UPDATE SET version = EXCLUDED.version,
        readable_from = EXCLUDED.readable_from, migrated_at = now();

-- outbox schema step 3: the blocking index over the ordering key's hash, replacing the one over the key (a btree row holds at most about 2.7 kB, and a longer key failed every claim that leased it) (online). Run each statement outside a transaction.
CREATE INDEX CONCURRENTLY IF NOT EXISTS "outbox_key_blockers_idx" ON "public"."outbox" ((hashtextextended(coalesce(partition_key, destination), 0)), sequence_id)
    WHERE delivered_at IS NULL AND (locked_by IS NOT NULL OR attempts > 0);
DROP INDEX CONCURRENTLY IF EXISTS "public"."outbox_blocking_idx";
-- (interrupted? an index it left INVALID must be dropped with DROP INDEX CONCURRENTLY first)
INSERT INTO "public"."outbox_versions" (component, version, readable_from) VALUES ('outbox', 3, 1)
    ON CONFLICT (component) DO UPDATE SET version = EXCLUDED.version,
        readable_from = EXCLUDED.readable_from, migrated_at = now();

-- outbox schema step 4: the scheduled rows' index (rows available later than written: the scan floor reads when the next comes due) (online). Run each statement outside a transaction.
CREATE INDEX CONCURRENTLY IF NOT EXISTS "outbox_scheduled_idx" ON "public"."outbox" (available_at)
    WHERE delivered_at IS NULL AND available_at > created_at;
-- (interrupted? an index it left INVALID must be dropped with DROP INDEX CONCURRENTLY first)
INSERT INTO "public"."outbox_versions" (component, version, readable_from) VALUES ('outbox', 4, 1)
    ON CONFLICT (component) DO UPDATE SET version = EXCLUDED.version,
        readable_from = EXCLUDED.readable_from, migrated_at = now();

-- outbox schema step 5: the nodes table's protocol column (rolling upgrades: which cluster protocol each node speaks; NULL for relays from before it) (NOT online: an ACCESS EXCLUSIVE lock on the nodes table (not the outbox) for a catalog change, milliseconds once granted; it waits at most 5 s for it (lock_timeout) and then fails rather than hold heartbeats up: run `migrate` again).
SET LOCAL lock_timeout = '5s';
ALTER TABLE "public"."outbox_nodes" ADD COLUMN IF NOT EXISTS protocol integer;
INSERT INTO "public"."outbox_versions" (component, version, readable_from) VALUES ('outbox', 5, 1)
    ON CONFLICT (component) DO UPDATE SET version = EXCLUDED.version,
        readable_from = EXCLUDED.readable_from, migrated_at = now();

-- outbox schema step 6: the nodes table's partitions_table column (which outbox's partitions each node takes: '' for none, NULL for relays from before it) (NOT online: an ACCESS EXCLUSIVE lock on the nodes table (not the outbox) for a catalog change, milliseconds once granted; it waits at most 5 s for it (lock_timeout) and then fails rather than hold heartbeats up: run `migrate` again).
SET LOCAL lock_timeout = '5s';
ALTER TABLE "public"."outbox_nodes" ADD COLUMN IF NOT EXISTS partitions_table text;
INSERT INTO "public"."outbox_versions" (component, version, readable_from) VALUES ('outbox', 6, 1)
    ON CONFLICT (component) DO UPDATE SET version = EXCLUDED.version,
        readable_from = EXCLUDED.readable_from, migrated_at = now();

-- outbox schema step 7: the nodes table's relays_outbox and claims columns (the outbox each node relays and how it takes its events: ordered, unordered or WAL capture; nodes of one outbox that take them two ways are refused) (NOT online: an ACCESS EXCLUSIVE lock on the nodes table (not the outbox) for a catalog change, milliseconds once granted; it waits at most 5 s for it (lock_timeout) and then fails rather than hold heartbeats up: run `migrate` again).
SET LOCAL lock_timeout = '5s';
ALTER TABLE "public"."outbox_nodes" ADD COLUMN IF NOT EXISTS relays_outbox text, ADD COLUMN IF NOT EXISTS claims text;
INSERT INTO "public"."outbox_versions" (component, version, readable_from) VALUES ('outbox', 7, 1)
    ON CONFLICT (component) DO UPDATE SET version = EXCLUDED.version,
        readable_from = EXCLUDED.readable_from, migrated_at = now();

-- outbox schema step 8: the nodes table's partition_count column (the count each ordered node splits keys by: a node started after the partitions table changed waits for the nodes of the old count to stop before it takes partitions) (NOT online: an ACCESS EXCLUSIVE lock on the nodes table (not the outbox) for a catalog change, milliseconds once granted; it waits at most 5 s for it (lock_timeout) and then fails rather than hold heartbeats up: run `migrate` again).
SET LOCAL lock_timeout = '5s';
ALTER TABLE "public"."outbox_nodes" ADD COLUMN IF NOT EXISTS partition_count integer;
INSERT INTO "public"."outbox_versions" (component, version, readable_from) VALUES ('outbox', 8, 1)
    ON CONFLICT (component) DO UPDATE SET version = EXCLUDED.version,
        readable_from = EXCLUDED.readable_from, migrated_at = now();

-- Wakes the relay after each inserting statement; never fails the application's insert.
CREATE OR REPLACE FUNCTION "public"."outbox_notify"() RETURNS trigger AS $$
BEGIN
    PERFORM pg_notify('outbox_relay', '');
    RETURN NULL;
EXCEPTION
    WHEN others THEN
        RAISE WARNING 'unexpected error in %: %', TG_NAME, SQLERRM;
        RETURN NULL;
END;
$$ LANGUAGE plpgsql;

DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_trigger WHERE tgname = 'outbox_trigger' AND tgrelid = '"public"."outbox"'::regclass) THEN
        CREATE TRIGGER "outbox_trigger" AFTER INSERT ON "public"."outbox"
            FOR EACH STATEMENT EXECUTE FUNCTION "public"."outbox_notify"();
    END IF;
END
$$;

-- public.outbox: grants
-- The relay's run-time role: no DDL, no access beyond these tables.
-- CREATE ROLE "relay" LOGIN PASSWORD '...';
GRANT USAGE ON SCHEMA "public" TO "relay";
GRANT SELECT, UPDATE, DELETE ON "public"."outbox" TO "relay";
-- To read how far ids have been handed out (claims then skip what they have been through).
-- The sequence's name is PostgreSQL's (it shortens long names its own way): ask for it.
DO $grant$ BEGIN
    EXECUTE format('GRANT SELECT ON SEQUENCE %s TO %s',
                   pg_get_serial_sequence('"public"."outbox"', 'sequence_id'), '"relay"');
END $grant$;
GRANT SELECT, INSERT ON "public"."outbox_dead_letters" TO "relay";
GRANT SELECT, INSERT, UPDATE, DELETE ON "public"."outbox_nodes" TO "relay";
GRANT SELECT, UPDATE ON "public"."outbox_partitions" TO "relay";
GRANT EXECUTE ON FUNCTION "public"."outbox_partition"(text, integer) TO "relay";
-- To refuse a schema older or newer than it runs on.
GRANT SELECT ON "public"."outbox_versions" TO "relay";
-- Applications (and `outbox-relay send`) also need:
--   GRANT INSERT ON "public"."outbox" TO app_role;
--   GRANT USAGE ON SEQUENCE <SELECT pg_get_serial_sequence('"public"."outbox"', 'sequence_id')> TO app_role;
-- Operators (`dead retry`, `dead purge`, `prune`) also need:
--   GRANT INSERT ON "public"."outbox" TO operator_role;
--   GRANT DELETE ON "public"."outbox_dead_letters" TO operator_role;

-- public.outbox: gated wake-up
-- Wakes the relay after each inserting statement; never fails the application's insert.
CREATE OR REPLACE FUNCTION "public"."outbox_notify"() RETURNS trigger AS $$
BEGIN
    -- Gated: only while a relay waits (it then holds this lock); a relay at work polls.
    IF NOT pg_try_advisory_xact_lock_shared(hashtext('outbox-relay wake-up public.outbox')) THEN
        PERFORM pg_notify('outbox_relay', '');
    END IF;
    RETURN NULL;
EXCEPTION
    WHEN others THEN
        RAISE WARNING 'unexpected error in %: %', TG_NAME, SQLERRM;
        RETURN NULL;
END;
$$ LANGUAGE plpgsql;

DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_trigger WHERE tgname = 'outbox_trigger' AND tgrelid = '"public"."outbox"'::regclass) THEN
        CREATE TRIGGER "outbox_trigger" AFTER INSERT ON "public"."outbox"
            FOR EACH STATEMENT EXECUTE FUNCTION "public"."outbox_notify"();
    END IF;
END
$$;

-- public.outbox: poll wake-up
-- Wakes the relay after each inserting statement; never fails the application's insert.
CREATE OR REPLACE FUNCTION "public"."outbox_notify"() RETURNS trigger AS $$
BEGIN
    -- --wakeup poll: no NOTIFY, so inserting transactions can PREPARE TRANSACTION.
    NULL;
    RETURN NULL;
EXCEPTION
    WHEN others THEN
        RAISE WARNING 'unexpected error in %: %', TG_NAME, SQLERRM;
        RETURN NULL;
END;
$$ LANGUAGE plpgsql;

DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_trigger WHERE tgname = 'outbox_trigger' AND tgrelid = '"public"."outbox"'::regclass) THEN
        CREATE TRIGGER "outbox_trigger" AFTER INSERT ON "public"."outbox"
            FOR EACH STATEMENT EXECUTE FUNCTION "public"."outbox_notify"();
    END IF;
END
$$;

-- app.events: ack_delete (row lease)
DELETE FROM "app"."events" o WHERE o.sequence_id = ANY($2) AND (o.event_id IN (SELECT unnest($3::uuid[])) OR o.sequence_id = ANY($4::int8[])) AND o.locked_by = $1 AND o.locked_until IS NOT NULL

-- app.events: ack_delete (partition fence)
DELETE FROM "app"."events" o WHERE o.sequence_id = ANY($2) AND (o.event_id IN (SELECT unnest($3::uuid[])) OR o.sequence_id = ANY($4::int8[])) AND (cardinality(CAST((SELECT coalesce(array_agg(pp.partition), '{}') FROM "app"."events_partitions" pp
                         JOIN unnest($5::int4[], $6::int8[]) AS h(partition, epoch) ON h.partition = pp.partition
                        WHERE pp.owner = $1 AND pp.epoch = h.epoch) AS int4[])) = $7 OR "app"."events_partition"(coalesce(o.partition_key, o.destination), $7) = ANY(CAST((SELECT coalesce(array_agg(pp.partition), '{}') FROM "app"."events_partitions" pp
                         JOIN unnest($5::int4[], $6::int8[]) AS h(partition, epoch) ON h.partition = pp.partition
                        WHERE pp.owner = $1 AND pp.epoch = h.epoch) AS int4[])))

-- app.events: ack_retain (row lease)
UPDATE "app"."events" o SET delivered_at = now(), locked_by = NULL, locked_until = NULL
                      WHERE o.sequence_id = ANY($2) AND (o.event_id IN (SELECT unnest($3::uuid[])) OR o.sequence_id = ANY($4::int8[])) AND o.locked_by = $1 AND o.locked_until IS NOT NULL

-- app.events: ack_retain (partition fence)
UPDATE "app"."events" o SET delivered_at = now(), locked_by = NULL, locked_until = NULL
                      WHERE o.sequence_id = ANY($2) AND (o.event_id IN (SELECT unnest($3::uuid[])) OR o.sequence_id = ANY($4::int8[])) AND (cardinality(CAST((SELECT coalesce(array_agg(pp.partition), '{}') FROM "app"."events_partitions" pp
                         JOIN unnest($5::int4[], $6::int8[]) AS h(partition, epoch) ON h.partition = pp.partition
                        WHERE pp.owner = $1 AND pp.epoch = h.epoch) AS int4[])) = $7 OR "app"."events_partition"(coalesce(o.partition_key, o.destination), $7) = ANY(CAST((SELECT coalesce(array_agg(pp.partition), '{}') FROM "app"."events_partitions" pp
                         JOIN unnest($5::int4[], $6::int8[]) AS h(partition, epoch) ON h.partition = pp.partition
                        WHERE pp.owner = $1 AND pp.epoch = h.epoch) AS int4[])))

-- app.events: retry_later (row lease)
UPDATE "app"."events" o
                        SET attempts = u.attempts, last_error = u.error,
                            available_at = now() + u.delay_ms * interval '1 millisecond',
                            locked_by = NULL, locked_until = NULL
                       FROM unnest($2::int8[], $3::int4[], $4::text[], $5::int8[], $6::uuid[])
                            AS u(sequence_id, attempts, error, delay_ms, event_id)
                      WHERE o.sequence_id = u.sequence_id AND (u.event_id IS NULL OR o.event_id = u.event_id) AND o.locked_by = $1 AND o.locked_until IS NOT NULL

-- app.events: retry_later (partition fence)
UPDATE "app"."events" o
                        SET attempts = u.attempts, last_error = u.error,
                            available_at = now() + u.delay_ms * interval '1 millisecond',
                            locked_by = NULL, locked_until = NULL
                       FROM unnest($2::int8[], $3::int4[], $4::text[], $5::int8[], $6::uuid[])
                            AS u(sequence_id, attempts, error, delay_ms, event_id)
                      WHERE o.sequence_id = u.sequence_id AND (u.event_id IS NULL OR o.event_id = u.event_id) AND (cardinality(CAST((SELECT coalesce(array_agg(pp.partition), '{}') FROM "app"."events_partitions" pp
                         JOIN unnest($7::int4[], $8::int8[]) AS h(partition, epoch) ON h.partition = pp.partition
                        WHERE pp.owner = $1 AND pp.epoch = h.epoch) AS int4[])) = $9 OR "app"."events_partition"(coalesce(o.partition_key, o.destination), $9) = ANY(CAST((SELECT coalesce(array_agg(pp.partition), '{}') FROM "app"."events_partitions" pp
                         JOIN unnest($7::int4[], $8::int8[]) AS h(partition, epoch) ON h.partition = pp.partition
                        WHERE pp.owner = $1 AND pp.epoch = h.epoch) AS int4[])))

-- app.events: dead_letter (row lease)
WITH moved AS (
                            DELETE FROM "app"."events" o
                             USING unnest($2::int8[], $3::int4[], $4::text[], $5::uuid[])
                                   AS u(sequence_id, attempts, error, event_id)
                             WHERE o.sequence_id = u.sequence_id AND (u.event_id IS NULL OR o.event_id = u.event_id) AND o.locked_by = $1 AND o.locked_until IS NOT NULL
                         RETURNING o.*, u.attempts AS final_attempts, u.error AS final_error)
                         INSERT INTO "app"."events_dead_letters" (sequence_id, event_id, destination, partition_key, event_type,
                                           payload, headers, mutation_id, rejected, created_at,
                                           attempts, last_error)
                         -- Undecodable rows too: a NULL where the dead letters allow none is
                         -- kept as an empty value (last_error says which it was).
                         SELECT sequence_id, coalesce(event_id, '00000000-0000-0000-0000-000000000000'),
                                coalesce(destination, ''), partition_key, coalesce(event_type, ''),
                                payload, coalesce(headers, '{}'), mutation_id, coalesce(rejected, false),
                                coalesce(created_at, now()), final_attempts, final_error
                           FROM moved

-- app.events: dead_letter (partition fence)
WITH moved AS (
                            DELETE FROM "app"."events" o
                             USING unnest($2::int8[], $3::int4[], $4::text[], $5::uuid[])
                                   AS u(sequence_id, attempts, error, event_id)
                             WHERE o.sequence_id = u.sequence_id AND (u.event_id IS NULL OR o.event_id = u.event_id) AND (cardinality(CAST((SELECT coalesce(array_agg(pp.partition), '{}') FROM "app"."events_partitions" pp
                         JOIN unnest($6::int4[], $7::int8[]) AS h(partition, epoch) ON h.partition = pp.partition
                        WHERE pp.owner = $1 AND pp.epoch = h.epoch) AS int4[])) = $8 OR "app"."events_partition"(coalesce(o.partition_key, o.destination), $8) = ANY(CAST((SELECT coalesce(array_agg(pp.partition), '{}') FROM "app"."events_partitions" pp
                         JOIN unnest($6::int4[], $7::int8[]) AS h(partition, epoch) ON h.partition = pp.partition
                        WHERE pp.owner = $1 AND pp.epoch = h.epoch) AS int4[])))
                         RETURNING o.*, u.attempts AS final_attempts, u.error AS final_error)
                         INSERT INTO "app"."events_dead_letters" (sequence_id, event_id, destination, partition_key, event_type,
                                           payload, headers, mutation_id, rejected, created_at,
                                           attempts, last_error)
                         -- Undecodable rows too: a NULL where the dead letters allow none is
                         -- kept as an empty value (last_error says which it was).
                         SELECT sequence_id, coalesce(event_id, '00000000-0000-0000-0000-000000000000'),
                                coalesce(destination, ''), partition_key, coalesce(event_type, ''),
                                payload, coalesce(headers, '{}'), mutation_id, coalesce(rejected, false),
                                coalesce(created_at, now()), final_attempts, final_error
                           FROM moved

-- app.events: claim
WITH locked AS (
                    SELECT o.sequence_id FROM "app"."events" o
                    WHERE o.delivered_at IS NULL
                      AND o.available_at <= now()
                      AND (o.locked_until IS NULL OR o.locked_until < now())
                       AND CASE WHEN NOT EXISTS (
                    SELECT 1 FROM "app"."events" p
                    WHERE hashtextextended(coalesce(p.partition_key, p.destination), 0) = hashtextextended(coalesce(o.partition_key, o.destination), 0) AND coalesce(p.partition_key, p.destination) = coalesce(o.partition_key, o.destination)
                      AND p.sequence_id < o.sequence_id
                      AND p.delivered_at IS NULL
                      AND (p.locked_by IS NOT NULL OR p.attempts > 0)
                      AND (p.available_at > now() OR (p.locked_until > now() AND p.locked_by <> $1))) THEN pg_try_advisory_xact_lock(hashtext('"app"."events"'), hashtext(coalesce(o.partition_key, o.destination))) ELSE false END
                    ORDER BY o.sequence_id
                    LIMIT $2
                    FOR UPDATE SKIP LOCKED),
                  passed AS (
                    SELECT coalesce(o.partition_key, o.destination) AS k, min(o.sequence_id) AS first
                    FROM "app"."events" o
                    WHERE o.delivered_at IS NULL
                      AND o.available_at <= now()
                      AND (o.locked_until IS NULL OR o.locked_until < now())
                      AND o.sequence_id < (SELECT max(sequence_id) FROM locked)
                      AND o.sequence_id NOT IN (SELECT sequence_id FROM locked)
                    GROUP BY 1),
                  claimable AS (
                    SELECT o.sequence_id FROM "app"."events" o JOIN locked l ON l.sequence_id = o.sequence_id
                    WHERE NOT EXISTS (
                    SELECT 1 FROM "app"."events" p
                    WHERE hashtextextended(coalesce(p.partition_key, p.destination), 0) = hashtextextended(coalesce(o.partition_key, o.destination), 0) AND coalesce(p.partition_key, p.destination) = coalesce(o.partition_key, o.destination)
                      AND p.sequence_id < o.sequence_id
                      AND p.delivered_at IS NULL
                      AND (p.locked_by IS NOT NULL OR p.attempts > 0)
                      AND ((p.locked_by IS DISTINCT FROM $1 OR p.locked_until IS NULL OR p.locked_until <= now())
                          AND p.sequence_id NOT IN (SELECT sequence_id FROM locked))) AND NOT EXISTS (SELECT 1 FROM passed WHERE passed.k = coalesce(o.partition_key, o.destination) AND passed.first < o.sequence_id))
                 UPDATE "app"."events" o
                    SET locked_by = $1, locked_until = now() + $3::int8 * interval '1 millisecond'
                   FROM claimable c
                  WHERE o.sequence_id = c.sequence_id
              RETURNING o.sequence_id, o.event_id, o.destination, o.partition_key, o.event_type, o.payload::text, o.headers::text, o.mutation_id, o.rejected, o.attempts, o.created_at

-- app.events: claim_owned
SELECT o.sequence_id, o.event_id, o.destination, o.partition_key, o.event_type, o.payload::text, o.headers::text, o.mutation_id, o.rejected, o.attempts, o.created_at FROM "app"."events" o
                  WHERE o.delivered_at IS NULL
                    AND o.available_at <= now()
                    AND o.sequence_id NOT IN (SELECT unnest($3::int8[]))
                    AND (cardinality(CAST((SELECT coalesce(array_agg(pp.partition), '{}') FROM "app"."events_partitions" pp
                     JOIN unnest($5::int4[], $6::int8[]) AS h(partition, epoch) ON h.partition = pp.partition
                    WHERE pp.owner = $1 AND pp.epoch = h.epoch AND pp.lease_until > now()) AS int4[])) = $4 OR "app"."events_partition"(coalesce(o.partition_key, o.destination), $4) = ANY(CAST((SELECT coalesce(array_agg(pp.partition), '{}') FROM "app"."events_partitions" pp
                     JOIN unnest($5::int4[], $6::int8[]) AS h(partition, epoch) ON h.partition = pp.partition
                    WHERE pp.owner = $1 AND pp.epoch = h.epoch AND pp.lease_until > now()) AS int4[])))
                    AND NOT EXISTS (
                    SELECT 1 FROM "app"."events" p
                    WHERE hashtextextended(coalesce(p.partition_key, p.destination), 0) = hashtextextended(coalesce(o.partition_key, o.destination), 0) AND coalesce(p.partition_key, p.destination) = coalesce(o.partition_key, o.destination)
                      AND p.sequence_id < o.sequence_id
                      AND p.delivered_at IS NULL
                      AND (p.locked_by IS NOT NULL OR p.attempts > 0)
                      AND (p.attempts > 0 AND p.available_at > now()))
                    AND $1::text IS NOT NULL
                    AND o.sequence_id >= $7
                    AND ($7 = '-9223372036854775808'::int8 OR $8::int8 IS NULL OR now() < to_timestamp($8::int8 / 1000000.0))
                    
                  ORDER BY o.sequence_id
                  LIMIT $2

-- app.events: claim_crowded
WITH locked AS (
                    SELECT o.sequence_id FROM "app"."events" o
                    WHERE o.delivered_at IS NULL
                      AND o.available_at <= now()
                      AND (o.locked_until IS NULL OR o.locked_until < now())
                      AND NOT (coalesce(o.partition_key, o.destination) = ANY($4::text[]))
                      AND o.sequence_id <= (SELECT coalesce(max(b.sequence_id), 0) FROM (
                            SELECT w.sequence_id FROM "app"."events" w
                             WHERE w.delivered_at IS NULL AND w.available_at <= now() AND (w.locked_until IS NULL OR w.locked_until < now())
                             ORDER BY w.sequence_id LIMIT $5) b) AND CASE WHEN NOT EXISTS (
                    SELECT 1 FROM "app"."events" p
                    WHERE hashtextextended(coalesce(p.partition_key, p.destination), 0) = hashtextextended(coalesce(o.partition_key, o.destination), 0) AND coalesce(p.partition_key, p.destination) = coalesce(o.partition_key, o.destination)
                      AND p.sequence_id < o.sequence_id
                      AND p.delivered_at IS NULL
                      AND (p.locked_by IS NOT NULL OR p.attempts > 0)
                      AND (p.available_at > now() OR (p.locked_until > now() AND p.locked_by <> $1))) THEN pg_try_advisory_xact_lock(hashtext('"app"."events"'), hashtext(coalesce(o.partition_key, o.destination))) ELSE false END
                    ORDER BY o.sequence_id
                    LIMIT $2
                    FOR UPDATE SKIP LOCKED),
                  passed AS (
                    SELECT coalesce(o.partition_key, o.destination) AS k, min(o.sequence_id) AS first
                    FROM "app"."events" o
                    WHERE o.delivered_at IS NULL
                      AND o.available_at <= now()
                      AND (o.locked_until IS NULL OR o.locked_until < now())
                      AND o.sequence_id < (SELECT max(sequence_id) FROM locked)
                      AND o.sequence_id NOT IN (SELECT sequence_id FROM locked)
                    GROUP BY 1),
                  claimable AS (
                    SELECT o.sequence_id FROM "app"."events" o JOIN locked l ON l.sequence_id = o.sequence_id
                    WHERE NOT EXISTS (
                    SELECT 1 FROM "app"."events" p
                    WHERE hashtextextended(coalesce(p.partition_key, p.destination), 0) = hashtextextended(coalesce(o.partition_key, o.destination), 0) AND coalesce(p.partition_key, p.destination) = coalesce(o.partition_key, o.destination)
                      AND p.sequence_id < o.sequence_id
                      AND p.delivered_at IS NULL
                      AND (p.locked_by IS NOT NULL OR p.attempts > 0)
                      AND ((p.locked_by IS DISTINCT FROM $1 OR p.locked_until IS NULL OR p.locked_until <= now())
                          AND p.sequence_id NOT IN (SELECT sequence_id FROM locked))) AND NOT EXISTS (SELECT 1 FROM passed WHERE passed.k = coalesce(o.partition_key, o.destination) AND passed.first < o.sequence_id))
                 UPDATE "app"."events" o
                    SET locked_by = $1, locked_until = now() + $3::int8 * interval '1 millisecond'
                   FROM claimable c
                  WHERE o.sequence_id = c.sequence_id
              RETURNING o.sequence_id, o.event_id, o.destination, o.partition_key, o.event_type, o.payload::text, o.headers::text, o.mutation_id, o.rejected, o.attempts, o.created_at

-- app.events: claim_owned_crowded
SELECT o.sequence_id, o.event_id, o.destination, o.partition_key, o.event_type, o.payload::text, o.headers::text, o.mutation_id, o.rejected, o.attempts, o.created_at FROM "app"."events" o
                  WHERE o.delivered_at IS NULL
                    AND o.available_at <= now()
                    AND o.sequence_id NOT IN (SELECT unnest($3::int8[]))
                    AND (cardinality(CAST((SELECT coalesce(array_agg(pp.partition), '{}') FROM "app"."events_partitions" pp
                     JOIN unnest($5::int4[], $6::int8[]) AS h(partition, epoch) ON h.partition = pp.partition
                    WHERE pp.owner = $1 AND pp.epoch = h.epoch AND pp.lease_until > now()) AS int4[])) = $4 OR "app"."events_partition"(coalesce(o.partition_key, o.destination), $4) = ANY(CAST((SELECT coalesce(array_agg(pp.partition), '{}') FROM "app"."events_partitions" pp
                     JOIN unnest($5::int4[], $6::int8[]) AS h(partition, epoch) ON h.partition = pp.partition
                    WHERE pp.owner = $1 AND pp.epoch = h.epoch AND pp.lease_until > now()) AS int4[])))
                    AND NOT EXISTS (
                    SELECT 1 FROM "app"."events" p
                    WHERE hashtextextended(coalesce(p.partition_key, p.destination), 0) = hashtextextended(coalesce(o.partition_key, o.destination), 0) AND coalesce(p.partition_key, p.destination) = coalesce(o.partition_key, o.destination)
                      AND p.sequence_id < o.sequence_id
                      AND p.delivered_at IS NULL
                      AND (p.locked_by IS NOT NULL OR p.attempts > 0)
                      AND (p.attempts > 0 AND p.available_at > now()))
                    AND $1::text IS NOT NULL
                    AND o.sequence_id >= $7
                    AND ($7 = '-9223372036854775808'::int8 OR $8::int8 IS NULL OR now() < to_timestamp($8::int8 / 1000000.0))
                    AND NOT (coalesce(o.partition_key, o.destination) = ANY($9::text[]))
                      AND o.sequence_id <= (SELECT coalesce(max(b.sequence_id), 0) FROM (
                            SELECT w.sequence_id FROM "app"."events" w
                             WHERE w.delivered_at IS NULL AND w.available_at <= now() AND w.sequence_id NOT IN (SELECT unnest($3::int8[]))
               AND (cardinality(CAST((SELECT coalesce(array_agg(pp.partition), '{}') FROM "app"."events_partitions" pp
                     JOIN unnest($5::int4[], $6::int8[]) AS h(partition, epoch) ON h.partition = pp.partition
                    WHERE pp.owner = $1 AND pp.epoch = h.epoch AND pp.lease_until > now()) AS int4[])) = $4
                    OR "app"."events_partition"(coalesce(w.partition_key, w.destination), $4) = ANY(CAST((SELECT coalesce(array_agg(pp.partition), '{}') FROM "app"."events_partitions" pp
                     JOIN unnest($5::int4[], $6::int8[]) AS h(partition, epoch) ON h.partition = pp.partition
                    WHERE pp.owner = $1 AND pp.epoch = h.epoch AND pp.lease_until > now()) AS int4[])))
                             ORDER BY w.sequence_id LIMIT $10) b)
                  ORDER BY o.sequence_id
                  LIMIT $2

-- app.events: floor_sequence
SELECT coalesce(pg_sequence_last_value(q.s), 0)::int8, q.s IS NOT NULL,
                        (SELECT seqcache FROM pg_catalog.pg_sequence WHERE seqrelid = q.s)::int8,
                        (SELECT seqincrement FROM pg_catalog.pg_sequence WHERE seqrelid = q.s)::int8,
                        to_regclass('"app"."events_scheduled_idx"') IS NOT NULL
                   FROM (SELECT pg_get_serial_sequence('"app"."events"', 'sequence_id')::regclass AS s) q

-- app.events: floor_writers
SELECT coalesce(array_agg(l.virtualtransaction), '{}') FROM pg_catalog.pg_locks l
                  WHERE l.locktype = 'relation'
                    AND l.relation IN ('"app"."events"'::regclass, pg_get_serial_sequence('"app"."events"', 'sequence_id')::regclass)
                    AND l.database = (SELECT oid FROM pg_catalog.pg_database WHERE datname = current_database())
                    AND l.mode IN ('RowExclusiveLock', 'ShareRowExclusiveLock', 'ExclusiveLock', 'AccessExclusiveLock')

-- app.events: floor_due
SELECT CASE WHEN isfinite(m) THEN (extract(epoch from m) * 1000000)::int8 END
                   FROM (SELECT min(o.available_at) AS m FROM "app"."events" o
                          WHERE o.delivered_at IS NULL AND o.available_at > o.created_at
                            AND o.available_at > now()
                            AND (cardinality($2::int4[]) = $3 OR "app"."events_partition"(coalesce(o.partition_key, o.destination), $3) = ANY($2::int4[]))
                            AND $1::text IS NOT NULL) d

-- app.events: floor_after
SELECT (SELECT count(*) FROM "app"."events_partitions" pp
                           JOIN unnest($2::int4[], $3::int8[]) AS h(partition, epoch) ON h.partition = pp.partition
                          WHERE pp.owner = $1 AND pp.epoch = h.epoch AND pp.lease_until > now())
                        = cardinality($2::int4[]),
                        coalesce(now() >= to_timestamp($4::int8 / 1000000.0), false)

-- app.events: claim_unordered
WITH locked AS (
                    SELECT o.sequence_id FROM "app"."events" o
                    WHERE o.delivered_at IS NULL
                      AND o.available_at <= now()
                      AND (o.locked_until IS NULL OR o.locked_until < now())
                      
                    ORDER BY o.sequence_id
                    LIMIT $2
                    FOR UPDATE SKIP LOCKED),
                  passed AS (
                    SELECT coalesce(o.partition_key, o.destination) AS k, min(o.sequence_id) AS first
                    FROM "app"."events" o
                    WHERE o.delivered_at IS NULL
                      AND o.available_at <= now()
                      AND (o.locked_until IS NULL OR o.locked_until < now())
                      AND o.sequence_id < (SELECT max(sequence_id) FROM locked)
                      AND o.sequence_id NOT IN (SELECT sequence_id FROM locked)
                    GROUP BY 1),
                  claimable AS (
                    SELECT o.sequence_id FROM "app"."events" o JOIN locked l ON l.sequence_id = o.sequence_id
                    WHERE true)
                 UPDATE "app"."events" o
                    SET locked_by = $1, locked_until = now() + $3::int8 * interval '1 millisecond'
                   FROM claimable c
                  WHERE o.sequence_id = c.sequence_id
              RETURNING o.sequence_id, o.event_id, o.destination, o.partition_key, o.event_type, o.payload::text, o.headers::text, o.mutation_id, o.rejected, o.attempts, o.created_at

-- app.events: release
UPDATE "app"."events" SET locked_until = NULL
                  WHERE sequence_id = ANY($2) AND locked_by = $1 AND locked_until IS NOT NULL

-- app.events: release_unheld
UPDATE "app"."events" SET locked_until = NULL
                  WHERE locked_by = $1 AND locked_until IS NOT NULL AND delivered_at IS NULL
                    AND sequence_id NOT IN (SELECT unnest($2::int8[]))

-- app.events: extend_leases
UPDATE "app"."events" SET locked_until = now() + $3::int8 * interval '1 millisecond'
                  WHERE sequence_id = ANY($2) AND locked_by = $1 AND locked_until IS NOT NULL

-- app.events: backlog
SELECT count(*)::int8,
                        count(*) FILTER (WHERE attempts > 0)::int8,
                        (extract(epoch from now() - min(CASE
        WHEN attempts > 0 THEN created_at
        WHEN available_at <= now() THEN greatest(created_at, available_at)
    END) FILTER (WHERE isfinite(created_at))) * 1000)::int8
                   FROM "app"."events" WHERE delivered_at IS NULL

-- app.events: dead_count
SELECT count(*)::int8 FROM "app"."events_dead_letters"

-- app.events: insert
INSERT INTO "app"."events" (event_id, destination, partition_key, event_type, payload,
                                  headers, mutation_id)
                 SELECT coalesce(u.event_id, gen_random_uuid()), u.destination, u.partition_key,
                        u.event_type, u.payload::jsonb, u.headers::jsonb, u.mutation_id
                   FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::text[],
                               $6::text[], $7::text[])
                        WITH ORDINALITY AS u(event_id, destination, partition_key, event_type,
                                             payload, headers, mutation_id, n)
                  ORDER BY u.n
              RETURNING sequence_id

-- app.events: heartbeat
WITH pushed AS (
                    UPDATE "app"."relay_nodes"
                       SET expiry = (now() AT TIME ZONE 'UTC') + $2::int8 * interval '1 millisecond'
                     WHERE id = $1
                       AND expiry = 'epoch'::timestamp + $3::int8 * interval '1 microsecond'
                 RETURNING expiry
                 ), inserted AS (
                    INSERT INTO "app"."relay_nodes" (id, expiry, partitions_table, relays_outbox, claims, partition_count)
                    SELECT $1, (now() AT TIME ZONE 'UTC') + $2::int8 * interval '1 millisecond', '', NULL, NULL, NULL
                     WHERE NOT EXISTS (SELECT 1 FROM pushed)
                        ON CONFLICT (id) DO NOTHING
                 RETURNING expiry
                 )
                 SELECT (extract(epoch from expiry) * 1000000)::int8, true FROM pushed
                 UNION ALL
                 SELECT (extract(epoch from expiry) * 1000000)::int8, true FROM inserted
                 UNION ALL
                 SELECT (extract(epoch from expiry) * 1000000)::int8, false FROM "app"."relay_nodes"
                  WHERE id = $1
                    AND NOT EXISTS (SELECT 1 FROM pushed)
                    AND NOT EXISTS (SELECT 1 FROM inserted)

-- app.events: remove_expired
DELETE FROM "app"."relay_nodes" WHERE expiry < (now() AT TIME ZONE 'UTC')

-- app.events: deregister
DELETE FROM "app"."relay_nodes"
                  WHERE id = $1 AND expiry = 'epoch'::timestamp + $2::int8 * interval '1 microsecond'

-- app.events: live_nodes
SELECT id, (extract(epoch from expiry) * 1000000)::int8 FROM "app"."relay_nodes"
                  WHERE expiry >= (now() AT TIME ZONE 'UTC') ORDER BY id

-- app.events: nodes_behind
WITH announced AS (
                    UPDATE "app"."relay_nodes" SET protocol = $2, partitions_table = '"app"."events_partitions"'
                     WHERE id = $1
                       AND (protocol IS DISTINCT FROM $2 OR partitions_table IS DISTINCT FROM '"app"."events_partitions"')
                 RETURNING id
                 )
                 SELECT id, coalesce(protocol, 1) FROM "app"."relay_nodes"
                  WHERE id <> $1 AND expiry >= (now() AT TIME ZONE 'UTC')
                    AND coalesce(protocol, 1) < $3
                  ORDER BY id

-- app.events: partition_peers
SELECT id FROM "app"."relay_nodes"
                  WHERE expiry >= (now() AT TIME ZONE 'UTC')
                    AND (partitions_table IS NULL OR partitions_table = '"app"."events_partitions"')
                  ORDER BY id

-- app.events: partition_count
SELECT count(*)::int8, (SELECT pg_encoding_to_char(encoding)::text FROM pg_database WHERE datname = current_database()),
              CASE WHEN count(*) > 0 AND (min(partition) <> 0 OR max(partition) <> count(*) - 1)
                   THEN (SELECT string_agg(n::text, ', ' ORDER BY n)
                           FROM generate_series(0, (SELECT max(partition) FROM "app"."events_partitions")) n
                          WHERE NOT EXISTS (SELECT FROM "app"."events_partitions" p WHERE p.partition = n)) END
              FROM "app"."events_partitions"

-- app.events: claim_mode_peers
WITH announced AS (
                    UPDATE "app"."relay_nodes"
                       SET partitions_table = CASE WHEN $2 = 'ordered' THEN '"app"."events_partitions"' ELSE '' END, relays_outbox = '"app"."events"', claims = $2,
                           partition_count = $4
                     WHERE id = $1 AND $3
                       AND (partitions_table IS DISTINCT FROM CASE WHEN $2 = 'ordered' THEN '"app"."events_partitions"' ELSE '' END
                            OR relays_outbox IS DISTINCT FROM '"app"."events"'
                            OR claims IS DISTINCT FROM $2
                            OR partition_count IS DISTINCT FROM $4)
                 RETURNING id
                 )
                 SELECT id, claims, partition_count FROM "app"."relay_nodes"
                  WHERE id <> $1 AND expiry >= (now() AT TIME ZONE 'UTC')
                    AND (relays_outbox = '"app"."events"' AND claims <> $2
                         OR claims IS NULL AND $2 <> 'ordered' AND partitions_table = '"app"."events_partitions"'
                         OR relays_outbox = '"app"."events"' AND claims = $2
                            AND partition_count <> $4)
                  ORDER BY id

-- app.events: acquire
UPDATE "app"."events_partitions"
                    SET owner = $1, epoch = epoch + 1,
                        lease_until = now() + $3::int8 * interval '1 millisecond'
                  WHERE partition = ANY($2::int4[])
                    AND (owner IS NULL OR owner = $1 OR lease_until IS NULL OR lease_until < now())
              RETURNING partition, epoch

-- app.events: renew
UPDATE "app"."events_partitions" p SET lease_until = now() + $4::int8 * interval '1 millisecond'
                   FROM unnest($2::int4[], $3::int8[]) AS h(partition, epoch)
                  WHERE p.partition = h.partition AND p.owner = $1 AND p.epoch = h.epoch
                    AND p.lease_until > now()
              RETURNING p.partition

-- app.events: release_partitions
UPDATE "app"."events_partitions" SET owner = NULL, lease_until = NULL
                  WHERE partition = ANY($2::int4[]) AND owner = $1

-- app.events: partitions
SELECT partition, owner, epoch, (extract(epoch from lease_until) * 1000000)::int8
                   FROM "app"."events_partitions" ORDER BY partition

-- app.events: register
WITH taken AS (
                    INSERT INTO "app"."relay_nodes" (id, expiry, partitions_table, relays_outbox, claims, partition_count)
                    VALUES ($1, (now() AT TIME ZONE 'UTC') + $2::int8 * interval '1 millisecond', '', NULL, NULL, NULL)
                        ON CONFLICT (id) DO UPDATE SET expiry = EXCLUDED.expiry, partitions_table = EXCLUDED.partitions_table, relays_outbox = NULL, claims = NULL, partition_count = NULL
                     WHERE "app"."relay_nodes".expiry < (now() AT TIME ZONE 'UTC')
                 RETURNING expiry
                 )
                 SELECT true, (extract(epoch from expiry) * 1000000)::int8 FROM taken
                 UNION ALL
                 SELECT false, (extract(epoch from expiry) * 1000000)::int8 FROM "app"."relay_nodes"
                  WHERE id = $1 AND NOT EXISTS (SELECT 1 FROM taken)

-- app.events: dead_retry (ids)
WITH chosen AS (
                        SELECT sequence_id, EXISTS (SELECT 1 FROM "app"."events" o
                                                     WHERE o.event_id = d.event_id
                                                        OR o.sequence_id = d.sequence_id) AS taken
                          FROM "app"."events_dead_letters" d WHERE sequence_id = ANY($1::int8[])),
                 moved AS (DELETE FROM "app"."events_dead_letters"
                            WHERE sequence_id IN (SELECT sequence_id FROM chosen WHERE NOT taken)
                        RETURNING *),
                 inserted AS (
                     INSERT INTO "app"."events" (sequence_id, event_id, destination, partition_key, event_type,
                                      payload, headers, mutation_id, rejected, created_at)
                     SELECT sequence_id, event_id, destination, partition_key, event_type,
                            payload, headers, mutation_id, rejected, created_at FROM moved
                     RETURNING 1)
                 SELECT (SELECT count(*) FROM inserted)::int8,
                        (SELECT count(*) FROM chosen WHERE taken)::int8

-- app.events: dead_retry (destination)
WITH chosen AS (
                        SELECT sequence_id, EXISTS (SELECT 1 FROM "app"."events" o
                                                     WHERE o.event_id = d.event_id
                                                        OR o.sequence_id = d.sequence_id) AS taken
                          FROM "app"."events_dead_letters" d WHERE destination = $1),
                 moved AS (DELETE FROM "app"."events_dead_letters"
                            WHERE sequence_id IN (SELECT sequence_id FROM chosen WHERE NOT taken)
                        RETURNING *),
                 inserted AS (
                     INSERT INTO "app"."events" (sequence_id, event_id, destination, partition_key, event_type,
                                      payload, headers, mutation_id, rejected, created_at)
                     SELECT sequence_id, event_id, destination, partition_key, event_type,
                            payload, headers, mutation_id, rejected, created_at FROM moved
                     RETURNING 1)
                 SELECT (SELECT count(*) FROM inserted)::int8,
                        (SELECT count(*) FROM chosen WHERE taken)::int8

-- app.events: dead_retry (all)
WITH chosen AS (
                        SELECT sequence_id, EXISTS (SELECT 1 FROM "app"."events" o
                                                     WHERE o.event_id = d.event_id
                                                        OR o.sequence_id = d.sequence_id) AS taken
                          FROM "app"."events_dead_letters" d WHERE $1::bool),
                 moved AS (DELETE FROM "app"."events_dead_letters"
                            WHERE sequence_id IN (SELECT sequence_id FROM chosen WHERE NOT taken)
                        RETURNING *),
                 inserted AS (
                     INSERT INTO "app"."events" (sequence_id, event_id, destination, partition_key, event_type,
                                      payload, headers, mutation_id, rejected, created_at)
                     SELECT sequence_id, event_id, destination, partition_key, event_type,
                            payload, headers, mutation_id, rejected, created_at FROM moved
                     RETURNING 1)
                 SELECT (SELECT count(*) FROM inserted)::int8,
                        (SELECT count(*) FROM chosen WHERE taken)::int8

-- app.events: dead_purge (ids)
DELETE FROM "app"."events_dead_letters" WHERE sequence_id = ANY($1::int8[])

-- app.events: dead_purge (destination)
DELETE FROM "app"."events_dead_letters" WHERE destination = $1

-- app.events: dead_purge (all)
DELETE FROM "app"."events_dead_letters" WHERE $1::bool

-- app.events: stats_pending
SELECT destination, count(*)::int8, count(*) FILTER (WHERE attempts > 0)::int8,
                            (extract(epoch from now() - min(CASE
        WHEN attempts > 0 THEN created_at
        WHEN available_at <= now() THEN greatest(created_at, available_at)
    END) FILTER (WHERE isfinite(created_at))) * 1000)::int8
                       FROM "app"."events" WHERE delivered_at IS NULL GROUP BY destination

-- app.events: stats_dead
SELECT destination, count(*)::int8 FROM "app"."events_dead_letters" GROUP BY destination

-- app.events: dead_list
SELECT sequence_id, event_id, destination, event_type, attempts::int8, last_error,
                            (extract(epoch from dead_at) * 1000000)::int8
                       FROM "app"."events_dead_letters"
                      WHERE ($1::text IS NULL OR destination = $1)
                        AND ($2::text IS NULL OR event_type = $2) AND sequence_id > $3
                      ORDER BY sequence_id LIMIT $4

-- app.events: event
SELECT sequence_id, event_id, destination, event_type, partition_key,
                            payload::text, headers::text, attempts::int8, last_error, CASE WHEN isfinite(created_at) THEN (extract(epoch from created_at) * 1000000)::int8 END,
                            delivered_at IS NOT NULL, false, NULL::int8
                       FROM "app"."events" WHERE sequence_id = $1
                     UNION ALL
                     SELECT sequence_id, event_id, destination, event_type, partition_key,
                            payload::text, headers::text, attempts::int8, last_error, CASE WHEN isfinite(created_at) THEN (extract(epoch from created_at) * 1000000)::int8 END,
                            false, true, CASE WHEN isfinite(dead_at) THEN (extract(epoch from dead_at) * 1000000)::int8 END
                       FROM "app"."events_dead_letters" WHERE sequence_id = $1

-- app.events: count_replayable
SELECT count(*)::int8 FROM "app"."events"
                      WHERE delivered_at IS NOT NULL AND created_at >= to_timestamp($1)
                        AND created_at < to_timestamp($2) AND ($3::text IS NULL OR destination = $3)

-- app.events: replay_batch
WITH b AS (
                        SELECT sequence_id FROM "app"."events"
                         WHERE delivered_at IS NOT NULL AND created_at >= to_timestamp($1)
                           AND created_at < to_timestamp($2) AND ($3::text IS NULL OR destination = $3)
                           AND sequence_id > $4
                         ORDER BY sequence_id LIMIT $5 FOR UPDATE)
                     UPDATE "app"."events" o SET delivered_at = NULL, attempts = 0, last_error = NULL,
                            available_at = now(), locked_by = NULL, locked_until = NULL
                       FROM b WHERE o.sequence_id = b.sequence_id
                     RETURNING o.sequence_id

-- app.events: wake_relays
SELECT pg_notify($1, '')

-- app.events: count_delivered_before
SELECT count(*)::int8 FROM "app"."events" WHERE delivered_at < to_timestamp($1)

-- app.events: count_dead_before
SELECT count(*)::int8 FROM "app"."events_dead_letters" WHERE dead_at < to_timestamp($1)

-- app.events: prune_delivered
DELETE FROM "app"."events" WHERE sequence_id IN (
                SELECT sequence_id FROM "app"."events" WHERE delivered_at < to_timestamp($1)
                 ORDER BY sequence_id LIMIT $2 FOR UPDATE SKIP LOCKED)

-- app.events: prune_dead
DELETE FROM "app"."events_dead_letters" WHERE sequence_id IN (
                SELECT sequence_id FROM "app"."events_dead_letters" WHERE dead_at < to_timestamp($1)
                 ORDER BY sequence_id LIMIT $2 FOR UPDATE SKIP LOCKED)

-- app.events: ddl
-- The schema's version per component, advanced after each step (see README, Upgrading).
DO $create_schema$ BEGIN IF to_regnamespace('"app"') IS NULL THEN CREATE SCHEMA "app"; END IF; END $create_schema$;
CREATE TABLE IF NOT EXISTS "app"."events_versions" (
    component     text PRIMARY KEY,
    version       integer NOT NULL,
    readable_from integer NOT NULL, -- the oldest schema version a relay must know to run on it
    migrated_at   timestamptz NOT NULL DEFAULT now()
);

-- outbox schema step 1: the outbox, dead-letter, partitions and nodes tables and the partition function, where missing (existing tables are not touched) (online).
DO $create_schema$ BEGIN IF to_regnamespace('"app"') IS NULL THEN CREATE SCHEMA "app"; END IF; END $create_schema$;
DO $create_schema$ BEGIN IF to_regnamespace('"app"') IS NULL THEN CREATE SCHEMA "app"; END IF; END $create_schema$;

-- Applications insert here, in the same transaction as their data change.
CREATE TABLE IF NOT EXISTS "app"."events" (
    sequence_id   bigserial PRIMARY KEY,          -- publish order
    event_id      uuid NOT NULL UNIQUE DEFAULT gen_random_uuid(), -- idempotency key sent to brokers
    destination   text NOT NULL,                  -- channel, topic or subject
    partition_key text,                           -- ordering key; NULL means the destination
    event_type    text NOT NULL,                  -- message name
    payload       jsonb,
    headers       jsonb NOT NULL DEFAULT '{}',
    mutation_id   text,
    rejected      boolean NOT NULL DEFAULT false,
    created_at    timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- relay bookkeeping: applications leave these alone (available_at may schedule delivery)
    available_at  timestamptz NOT NULL DEFAULT now(),
    attempts      integer NOT NULL DEFAULT 0,
    last_error    text,
    locked_by     text,
    locked_until  timestamptz,
    delivered_at  timestamptz                     -- set only with --retain-delivered
);

-- Events that can never be delivered, whole, with their attempts and last error.
CREATE TABLE IF NOT EXISTS "app"."events_dead_letters" (
    sequence_id   bigint PRIMARY KEY,
    event_id      uuid NOT NULL,
    destination   text NOT NULL,
    partition_key text,
    event_type    text NOT NULL,
    payload       jsonb,
    headers       jsonb NOT NULL DEFAULT '{}',
    mutation_id   text,
    rejected      boolean NOT NULL DEFAULT false,
    created_at    timestamptz NOT NULL,
    attempts      integer NOT NULL,
    last_error    text NOT NULL,
    dead_at       timestamptz NOT NULL DEFAULT now()
);

-- A key's partition: the first 4 bytes of md5(key), sign bit cleared, modulo the count.
CREATE OR REPLACE FUNCTION "app"."events_partition"(key text, partitions integer) RETURNS integer
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    AS $$ SELECT ((('x' || substr(md5(key), 1, 8))::bit(32)::integer) & 2147483647) % partitions $$;

-- Partition leases: one owner at a time, a fencing epoch that grows with every takeover.
CREATE TABLE IF NOT EXISTS "app"."events_partitions" (
    partition   integer PRIMARY KEY,
    owner       text,
    epoch       bigint NOT NULL DEFAULT 0,
    lease_until timestamptz
);
INSERT INTO "app"."events_partitions" (partition)
    SELECT generate_series(0, 64 - 1)
    WHERE NOT EXISTS (SELECT 1 FROM "app"."events_partitions");

-- Relay nodes and their heartbeats (the Ably connector's nodes table).
CREATE TABLE IF NOT EXISTS "app"."relay_nodes" (
    id     text PRIMARY KEY,
    expiry timestamp without time zone NOT NULL
);
INSERT INTO "app"."events_versions" (component, version, readable_from) VALUES ('outbox', 1, 1)
    ON CONFLICT (component) DO UPDATE SET version = EXCLUDED.version,
        readable_from = EXCLUDED.readable_from, migrated_at = now();

-- outbox schema step 2: the pending rows' index (the claim scan) (online). Run each statement outside a transaction.
CREATE INDEX CONCURRENTLY IF NOT EXISTS "events_pending_idx" ON "app"."events" (sequence_id) WHERE delivered_at IS NULL;
-- (interrupted? an index it left INVALID must be dropped with DROP INDEX CONCURRENTLY first)
INSERT INTO "app"."events_versions" (component, version, readable_from) VALUES ('outbox', 2, 1)
    ON CONFLICT (component) DO UPDATE SET version = EXCLUDED.version,
        readable_from = EXCLUDED.readable_from, migrated_at = now();

-- outbox schema step 3: the blocking index over the ordering key's hash, replacing the one over the key (a btree row holds at most about 2.7 kB, and a longer key failed every claim that leased it) (online). Run each statement outside a transaction.
CREATE INDEX CONCURRENTLY IF NOT EXISTS "events_key_blockers_idx" ON "app"."events" ((hashtextextended(coalesce(partition_key, destination), 0)), sequence_id)
    WHERE delivered_at IS NULL AND (locked_by IS NOT NULL OR attempts > 0);
DROP INDEX CONCURRENTLY IF EXISTS "app"."events_blocking_idx";
-- (interrupted? an index it left INVALID must be dropped with DROP INDEX CONCURRENTLY first)
INSERT INTO "app"."events_versions" (component, version, readable_from) VALUES ('outbox', 3, 1)
    ON CONFLICT (component) DO UPDATE SET version = EXCLUDED.version,
        readable_from = EXCLUDED.readable_from, migrated_at = now();

-- outbox schema step 4: the scheduled rows' index (rows available later than written: the scan floor reads when the next comes due) (online). Run each statement outside a transaction.
CREATE INDEX CONCURRENTLY IF NOT EXISTS "events_scheduled_idx" ON "app"."events" (available_at)
    WHERE delivered_at IS NULL AND available_at > created_at;
-- (interrupted? an index it left INVALID must be dropped with DROP INDEX CONCURRENTLY first)
INSERT INTO "app"."events_versions" (component, version, readable_from) VALUES ('outbox', 4, 1)
    ON CONFLICT (component) DO UPDATE SET version = EXCLUDED.version,
        readable_from = EXCLUDED.readable_from, migrated_at = now();

-- outbox schema step 5: the nodes table's protocol column (rolling upgrades: which cluster protocol each node speaks; NULL for relays from before it) (NOT online: an ACCESS EXCLUSIVE lock on the nodes table (not the outbox) for a catalog change, milliseconds once granted; it waits at most 5 s for it (lock_timeout) and then fails rather than hold heartbeats up: run `migrate` again).
SET LOCAL lock_timeout = '5s';
ALTER TABLE "app"."relay_nodes" ADD COLUMN IF NOT EXISTS protocol integer;
INSERT INTO "app"."events_versions" (component, version, readable_from) VALUES ('outbox', 5, 1)
    ON CONFLICT (component) DO UPDATE SET version = EXCLUDED.version,
        readable_from = EXCLUDED.readable_from, migrated_at = now();

-- outbox schema step 6: the nodes table's partitions_table column (which outbox's partitions each node takes: '' for none, NULL for relays from before it) (NOT online: an ACCESS EXCLUSIVE lock on the nodes table (not the outbox) for a catalog change, milliseconds once granted; it waits at most 5 s for it (lock_timeout) and then fails rather than hold heartbeats up: run `migrate` again).
SET LOCAL lock_timeout = '5s';
ALTER TABLE "app"."relay_nodes" ADD COLUMN IF NOT EXISTS partitions_table text;
INSERT INTO "app"."events_versions" (component, version, readable_from) VALUES ('outbox', 6, 1)
    ON CONFLICT (component) DO UPDATE SET version = EXCLUDED.version,
        readable_from = EXCLUDED.readable_from, migrated_at = now();

-- outbox schema step 7: the nodes table's relays_outbox and claims columns (the outbox each node relays and how it takes its events: ordered, unordered or WAL capture; nodes of one outbox that take them two ways are refused) (NOT online: an ACCESS EXCLUSIVE lock on the nodes table (not the outbox) for a catalog change, milliseconds once granted; it waits at most 5 s for it (lock_timeout) and then fails rather than hold heartbeats up: run `migrate` again).
SET LOCAL lock_timeout = '5s';
ALTER TABLE "app"."relay_nodes" ADD COLUMN IF NOT EXISTS relays_outbox text, ADD COLUMN IF NOT EXISTS claims text;
INSERT INTO "app"."events_versions" (component, version, readable_from) VALUES ('outbox', 7, 1)
    ON CONFLICT (component) DO UPDATE SET version = EXCLUDED.version,
        readable_from = EXCLUDED.readable_from, migrated_at = now();

-- outbox schema step 8: the nodes table's partition_count column (the count each ordered node splits keys by: a node started after the partitions table changed waits for the nodes of the old count to stop before it takes partitions) (NOT online: an ACCESS EXCLUSIVE lock on the nodes table (not the outbox) for a catalog change, milliseconds once granted; it waits at most 5 s for it (lock_timeout) and then fails rather than hold heartbeats up: run `migrate` again).
SET LOCAL lock_timeout = '5s';
ALTER TABLE "app"."relay_nodes" ADD COLUMN IF NOT EXISTS partition_count integer;
INSERT INTO "app"."events_versions" (component, version, readable_from) VALUES ('outbox', 8, 1)
    ON CONFLICT (component) DO UPDATE SET version = EXCLUDED.version,
        readable_from = EXCLUDED.readable_from, migrated_at = now();

-- Wakes the relay after each inserting statement; never fails the application's insert.
CREATE OR REPLACE FUNCTION "app"."events_notify"() RETURNS trigger AS $$
BEGIN
    PERFORM pg_notify('outbox_relay', '');
    RETURN NULL;
EXCEPTION
    WHEN others THEN
        RAISE WARNING 'unexpected error in %: %', TG_NAME, SQLERRM;
        RETURN NULL;
END;
$$ LANGUAGE plpgsql;

DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_trigger WHERE tgname = 'events_trigger' AND tgrelid = '"app"."events"'::regclass) THEN
        CREATE TRIGGER "events_trigger" AFTER INSERT ON "app"."events"
            FOR EACH STATEMENT EXECUTE FUNCTION "app"."events_notify"();
    END IF;
END
$$;

-- app.events: grants
-- The relay's run-time role: no DDL, no access beyond these tables.
-- CREATE ROLE "relay" LOGIN PASSWORD '...';
GRANT USAGE ON SCHEMA "app" TO "relay";
GRANT SELECT, UPDATE, DELETE ON "app"."events" TO "relay";
-- To read how far ids have been handed out (claims then skip what they have been through).
-- The sequence's name is PostgreSQL's (it shortens long names its own way): ask for it.
DO $grant$ BEGIN
    EXECUTE format('GRANT SELECT ON SEQUENCE %s TO %s',
                   pg_get_serial_sequence('"app"."events"', 'sequence_id'), '"relay"');
END $grant$;
GRANT SELECT, INSERT ON "app"."events_dead_letters" TO "relay";
GRANT SELECT, INSERT, UPDATE, DELETE ON "app"."relay_nodes" TO "relay";
GRANT SELECT, UPDATE ON "app"."events_partitions" TO "relay";
GRANT EXECUTE ON FUNCTION "app"."events_partition"(text, integer) TO "relay";
-- To refuse a schema older or newer than it runs on.
GRANT SELECT ON "app"."events_versions" TO "relay";
-- Applications (and `outbox-relay send`) also need:
--   GRANT INSERT ON "app"."events" TO app_role;
--   GRANT USAGE ON SEQUENCE <SELECT pg_get_serial_sequence('"app"."events"', 'sequence_id')> TO app_role;
-- Operators (`dead retry`, `dead purge`, `prune`) also need:
--   GRANT INSERT ON "app"."events" TO operator_role;
--   GRANT DELETE ON "app"."events_dead_letters" TO operator_role;

-- app.events: gated wake-up
-- Wakes the relay after each inserting statement; never fails the application's insert.
CREATE OR REPLACE FUNCTION "app"."events_notify"() RETURNS trigger AS $$
BEGIN
    -- Gated: only while a relay waits (it then holds this lock); a relay at work polls.
    IF NOT pg_try_advisory_xact_lock_shared(hashtext('outbox-relay wake-up app.events')) THEN
        PERFORM pg_notify('outbox_relay', '');
    END IF;
    RETURN NULL;
EXCEPTION
    WHEN others THEN
        RAISE WARNING 'unexpected error in %: %', TG_NAME, SQLERRM;
        RETURN NULL;
END;
$$ LANGUAGE plpgsql;

DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_trigger WHERE tgname = 'events_trigger' AND tgrelid = '"app"."events"'::regclass) THEN
        CREATE TRIGGER "events_trigger" AFTER INSERT ON "app"."events"
            FOR EACH STATEMENT EXECUTE FUNCTION "app"."events_notify"();
    END IF;
END
$$;

-- app.events: poll wake-up
-- Wakes the relay after each inserting statement; never fails the application's insert.
CREATE OR REPLACE FUNCTION "app"."events_notify"() RETURNS trigger AS $$
BEGIN
    -- --wakeup poll: no NOTIFY, so inserting transactions can PREPARE TRANSACTION.
    NULL;
    RETURN NULL;
EXCEPTION
    WHEN others THEN
        RAISE WARNING 'unexpected error in %: %', TG_NAME, SQLERRM;
        RETURN NULL;
END;
$$ LANGUAGE plpgsql;

DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_trigger WHERE tgname = 'events_trigger' AND tgrelid = '"app"."events"'::regclass) THEN
        CREATE TRIGGER "events_trigger" AFTER INSERT ON "app"."events"
            FOR EACH STATEMENT EXECUTE FUNCTION "app"."events_notify"();
    END IF;
END
$$;

