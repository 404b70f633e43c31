-- Tenants, API keys and the audit log (SQLite).
-- Timestamps are unix milliseconds; booleans are BIGINT 0/1; limits and
-- model lists are JSON text. Keep in step with ../postgres.

CREATE TABLE tenants (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    name        TEXT    NOT NULL UNIQUE,
    namespace   TEXT    NOT NULL,
    priority    TEXT    NOT NULL,
    limits      TEXT    NOT NULL,
    log_prompts BIGINT  NOT NULL DEFAULT 0,
    disabled    BIGINT  NOT NULL DEFAULT 0,
    created_ms  BIGINT  NOT NULL
);

CREATE TABLE api_keys (
    id           INTEGER PRIMARY KEY AUTOINCREMENT,
    tenant_id    BIGINT  NOT NULL REFERENCES tenants (id),
    name         TEXT,
    prefix       TEXT    NOT NULL,
    key_hash     TEXT    NOT NULL UNIQUE,
    models       TEXT,
    expires_ms   BIGINT,
    limits       TEXT    NOT NULL,
    revoked_ms   BIGINT,
    created_ms   BIGINT  NOT NULL,
    last_used_ms BIGINT
);

CREATE INDEX api_keys_tenant ON api_keys (tenant_id);

CREATE TABLE audit_log (
    id                INTEGER PRIMARY KEY AUTOINCREMENT,
    time_ms           BIGINT  NOT NULL,
    request_id        TEXT    NOT NULL,
    tenant_id         BIGINT,
    tenant            TEXT,
    key_id            BIGINT,
    endpoint          TEXT    NOT NULL,
    model             TEXT,
    upstream          TEXT,
    status            BIGINT  NOT NULL,
    error_code        TEXT,
    stream            BIGINT  NOT NULL,
    prompt_tokens     BIGINT  NOT NULL,
    completion_tokens BIGINT  NOT NULL,
    cached_tokens     BIGINT  NOT NULL,
    latency_ms        DOUBLE PRECISION NOT NULL,
    ttft_ms           DOUBLE PRECISION,
    prompt            TEXT
);

CREATE INDEX audit_log_time ON audit_log (time_ms);
CREATE INDEX audit_log_tenant_time ON audit_log (tenant, time_ms);
