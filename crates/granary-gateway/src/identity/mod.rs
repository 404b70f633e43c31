//! Tenants, API keys, audit records and usage, in SQLite or PostgreSQL.
