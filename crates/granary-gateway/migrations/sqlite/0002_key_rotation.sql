-- Key rotation: the secret a key had before its last rotation stays valid
-- until old_expires_ms. Keep in step with ../postgres.
ALTER TABLE api_keys ADD COLUMN old_key_hash TEXT;
ALTER TABLE api_keys ADD COLUMN old_expires_ms BIGINT;
CREATE INDEX api_keys_old_hash ON api_keys (old_key_hash);
