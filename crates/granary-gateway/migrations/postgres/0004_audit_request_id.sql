-- A request is audited once. An audit batch whose commit reached the
-- database but whose answer did not (a timeout) is written again, as is a
-- spooled batch replayed after a crash; inserts skip a request id already
-- there, and only the rows inserted are added to usage_daily. Request ids
-- are the gateway's own (never a client's). Duplicates that such retries
-- left before this are dropped (the first row of each id is kept).
-- Keep in step with ../sqlite.
DELETE FROM audit_log WHERE id NOT IN (SELECT MIN(id) FROM audit_log GROUP BY request_id);
CREATE UNIQUE INDEX audit_log_request_id ON audit_log (request_id);
