-- Usage per tenant, key and model per UTC day, written with the audit
-- batches; day and month token budgets are reloaded from it at start.
-- key_id 0: a request without a key; model '': without a model.
-- Keep in step with ../sqlite.
CREATE TABLE usage_daily (
    tenant_id         BIGINT NOT NULL,
    key_id            BIGINT NOT NULL,
    model             TEXT   NOT NULL,
    day_ms            BIGINT NOT NULL,
    requests          BIGINT NOT NULL,
    errors            BIGINT NOT NULL,
    prompt_tokens     BIGINT NOT NULL,
    completion_tokens BIGINT NOT NULL,
    cached_tokens     BIGINT NOT NULL,
    PRIMARY KEY (tenant_id, key_id, model, day_ms)
);
CREATE INDEX usage_daily_day ON usage_daily (day_ms);
