-- The registry's catalog (SQLite): revisions of models and their files.
-- Timestamps are unix milliseconds. A model exists while it has a revision.
-- Version numbers start at 1001 so that they never collide with another
-- component's migrations; still, give the registry a database of its own.
-- Keep in step with ../postgres.

CREATE TABLE revisions (
    id         INTEGER PRIMARY KEY AUTOINCREMENT,
    name       TEXT    NOT NULL,
    revision   TEXT    NOT NULL,
    format     TEXT    NOT NULL,
    license    TEXT,
    source     TEXT,
    size       BIGINT  NOT NULL,
    created_ms BIGINT  NOT NULL,
    UNIQUE (name, revision)
);

CREATE TABLE files (
    revision_id BIGINT NOT NULL REFERENCES revisions (id),
    path        TEXT   NOT NULL,
    size        BIGINT NOT NULL,
    sha256      TEXT   NOT NULL,
    PRIMARY KEY (revision_id, path)
);

CREATE INDEX files_sha256 ON files (sha256);
