//! The catalog: which revisions exist and which files (path, size, sha256)
//! each holds, in SQLite or PostgreSQL.
//!
//! One code path through `sqlx::Any`: the URL's scheme picks the driver
//! (`sqlite:///path/registry.db`, `sqlite::memory:`, `postgres://…`) and the
//! migration set (`migrations/sqlite` or `migrations/postgres`, the same
//! tables); every query is written once, in SQL both accept. A revision and
//! its files are written in one transaction, so a revision is never seen
//! half recorded.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::Context as _;
use sqlx::any::{AnyPoolOptions, AnyRow};
use sqlx::{AnyPool, Row};

use crate::api::{FileEntry, Model, ModelSummary, Revision, LATEST};
use crate::error::RegistryError;

type Result<T, E = RegistryError> = std::result::Result<T, E>;

/// Counts for `/metrics`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CatalogCounts {
    pub models: u64,
    pub revisions: u64,
    pub files: u64,
    /// Sum of the revisions' sizes (a blob shared by two revisions counts twice).
    pub bytes: u64,
}

/// The catalog. Cheap to clone.
#[derive(Clone)]
pub struct Catalog {
    pool: AnyPool,
    backend: &'static str,
}

fn backend_of(url: &str) -> anyhow::Result<&'static str> {
    if url.starts_with("sqlite:") {
        Ok("sqlite")
    } else if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        Ok("postgres")
    } else {
        anyhow::bail!("unsupported database URL {url:?} (expected sqlite:///PATH, sqlite::memory: or postgres://…)")
    }
}

/// The file path of an SQLite URL, when it names one.
fn sqlite_path(url: &str) -> Option<&str> {
    if url.contains(":memory:") {
        return None;
    }
    let rest = url.strip_prefix("sqlite://").or_else(|| url.strip_prefix("sqlite:"))?;
    let path = rest.split('?').next().unwrap_or(rest);
    (!path.is_empty()).then_some(path)
}

impl Catalog {
    /// Connects (creating an SQLite file and its directory when missing) and
    /// runs the migrations.
    pub async fn open(url: &str) -> anyhow::Result<Self> {
        sqlx::any::install_default_drivers();
        let backend = backend_of(url)?;
        let mut options = AnyPoolOptions::new().acquire_timeout(Duration::from_secs(10));
        let connect_url = if backend == "sqlite" {
            if url.contains(":memory:") {
                // Every connection to `sqlite::memory:` is a database of its
                // own: keep exactly one, forever.
                options = options.max_connections(1).min_connections(1).idle_timeout(None).max_lifetime(None);
                url.to_string()
            } else {
                if let Some(dir) = sqlite_path(url).and_then(|p| std::path::Path::new(p).parent()) {
                    if !dir.as_os_str().is_empty() {
                        std::fs::create_dir_all(dir)
                            .with_context(|| format!("creating the directory {}", dir.display()))?;
                    }
                }
                options = options.max_connections(4);
                if url.contains("mode=") {
                    url.to_string()
                } else {
                    format!("{url}{}mode=rwc", if url.contains('?') { '&' } else { '?' })
                }
            }
        } else {
            options = options.max_connections(16);
            url.to_string()
        };
        let pool =
            options.connect(&connect_url).await.with_context(|| format!("connecting to the {backend} catalog"))?;
        let mut migrator = if backend == "sqlite" {
            sqlx::migrate!("./migrations/sqlite")
        } else {
            sqlx::migrate!("./migrations/postgres")
        };
        // Another component's migrations in the same database are not ours
        // to judge.
        migrator.set_ignore_missing(true);
        migrator
            .run(&pool)
            .await
            .context("migrating the registry catalog (the registry needs a database of its own)")?;
        Ok(Catalog { pool, backend })
    }

    /// `"sqlite"` or `"postgres"`.
    pub fn backend(&self) -> &'static str {
        self.backend
    }

    /// Every model, by name, with its revisions oldest first.
    pub async fn list(&self) -> Result<Vec<ModelSummary>> {
        let rows = sqlx::query("SELECT name, revision FROM revisions ORDER BY name, created_ms, id")
            .fetch_all(&self.pool)
            .await?;
        let mut models: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for r in rows {
            let name: String = r.try_get(0)?;
            models.entry(name).or_default().push(r.try_get(1)?);
        }
        Ok(models
            .into_iter()
            .map(|(name, revisions)| ModelSummary {
                latest: revisions.last().cloned().unwrap_or_default(),
                name,
                revisions,
            })
            .collect())
    }

    /// A model and all its revisions, oldest first.
    pub async fn model(&self, name: &str) -> Result<Option<Model>> {
        let rows = sqlx::query(
            "SELECT id, name, revision, format, license, source, size, created_ms \
             FROM revisions WHERE name = $1 ORDER BY created_ms, id",
        )
        .bind(name)
        .fetch_all(&self.pool)
        .await?;
        if rows.is_empty() {
            return Ok(None);
        }
        let mut revisions = Vec::with_capacity(rows.len());
        for r in &rows {
            let (id, rev) = revision_row(r)?;
            revisions.push(self.with_files(id, rev).await?);
        }
        let latest = revisions.last().map(|r| r.revision.clone()).unwrap_or_default();
        Ok(Some(Model { name: name.to_string(), latest, revisions }))
    }

    /// One revision; `rev` may be `latest`.
    pub async fn revision(&self, name: &str, rev: &str) -> Result<Option<Revision>> {
        let cols = "SELECT id, name, revision, format, license, source, size, created_ms FROM revisions";
        let row = if rev == LATEST {
            sqlx::query(&format!("{cols} WHERE name = $1 ORDER BY created_ms DESC, id DESC LIMIT 1"))
                .bind(name)
                .fetch_optional(&self.pool)
                .await?
        } else {
            sqlx::query(&format!("{cols} WHERE name = $1 AND revision = $2"))
                .bind(name)
                .bind(rev)
                .fetch_optional(&self.pool)
                .await?
        };
        let Some(row) = row else { return Ok(None) };
        let (id, rev) = revision_row(&row)?;
        Ok(Some(self.with_files(id, rev).await?))
    }

    async fn with_files(&self, id: i64, mut rev: Revision) -> Result<Revision> {
        let rows = sqlx::query("SELECT path, size, sha256 FROM files WHERE revision_id = $1 ORDER BY path")
            .bind(id)
            .fetch_all(&self.pool)
            .await?;
        rev.files = rows
            .iter()
            .map(|r| Ok(FileEntry { path: r.try_get(0)?, size: u64_col(r, 1)?, sha256: r.try_get(2)? }))
            .collect::<Result<_, sqlx::Error>>()?;
        Ok(rev)
    }

    /// Whether `name`@`rev` is recorded.
    pub async fn exists(&self, name: &str, rev: &str) -> Result<bool> {
        let row = sqlx::query("SELECT id FROM revisions WHERE name = $1 AND revision = $2")
            .bind(name)
            .bind(rev)
            .fetch_optional(&self.pool)
            .await?;
        Ok(row.is_some())
    }

    /// Records a revision and its files in one transaction, with
    /// `created_ms` as its time; [`RegistryError::Conflict`] if it exists.
    pub async fn insert(&self, rev: &Revision, created_ms: i64) -> Result<()> {
        let mut tx = self.pool.begin().await?;
        let inserted = sqlx::query(
            "INSERT INTO revisions (name, revision, format, license, source, size, created_ms) \
             VALUES ($1, $2, $3, $4, $5, $6, $7) RETURNING id",
        )
        .bind(rev.name.clone())
        .bind(rev.revision.clone())
        .bind(rev.format.clone())
        .bind(rev.license.clone())
        .bind(rev.source.clone())
        .bind(i64_of(rev.size)?)
        .bind(created_ms)
        .fetch_one(&mut *tx)
        .await;
        let id: i64 = match inserted {
            Ok(row) => row.try_get(0)?,
            Err(e) if is_unique_violation(&e) => return Err(conflict(&rev.name, &rev.revision)),
            Err(e) => return Err(e.into()),
        };
        for f in &rev.files {
            sqlx::query("INSERT INTO files (revision_id, path, size, sha256) VALUES ($1, $2, $3, $4)")
                .bind(id)
                .bind(f.path.clone())
                .bind(i64_of(f.size)?)
                .bind(f.sha256.clone())
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// Deletes one revision (`rev` `Some`, may be `latest`) or every revision
    /// of the model; returns the sha256 of every file they held, or `None`
    /// when there was nothing to delete.
    pub async fn delete(&self, name: &str, rev: Option<&str>) -> Result<Option<Vec<String>>> {
        let mut tx = self.pool.begin().await?;
        let ids: Vec<i64> = match rev {
            Some(LATEST) => {
                sqlx::query("SELECT id FROM revisions WHERE name = $1 ORDER BY created_ms DESC, id DESC LIMIT 1")
                    .bind(name)
                    .fetch_all(&mut *tx)
                    .await?
            }
            Some(r) => {
                sqlx::query("SELECT id FROM revisions WHERE name = $1 AND revision = $2")
                    .bind(name)
                    .bind(r)
                    .fetch_all(&mut *tx)
                    .await?
            }
            None => sqlx::query("SELECT id FROM revisions WHERE name = $1").bind(name).fetch_all(&mut *tx).await?,
        }
        .iter()
        .map(|r| r.try_get(0))
        .collect::<Result<_, _>>()?;
        if ids.is_empty() {
            return Ok(None);
        }
        let mut shas = Vec::new();
        for id in ids {
            for r in sqlx::query("SELECT sha256 FROM files WHERE revision_id = $1").bind(id).fetch_all(&mut *tx).await?
            {
                shas.push(r.try_get::<String, _>(0)?);
            }
            sqlx::query("DELETE FROM files WHERE revision_id = $1").bind(id).execute(&mut *tx).await?;
            sqlx::query("DELETE FROM revisions WHERE id = $1").bind(id).execute(&mut *tx).await?;
        }
        tx.commit().await?;
        shas.sort();
        shas.dedup();
        Ok(Some(shas))
    }

    /// The size of the blob `sha256` as a file of some revision records it,
    /// or `None` when no revision references it.
    pub async fn blob_size(&self, sha256: &str) -> Result<Option<u64>> {
        let row = sqlx::query("SELECT size FROM files WHERE sha256 = $1 LIMIT 1")
            .bind(sha256)
            .fetch_optional(&self.pool)
            .await?;
        row.map(|r| u64_col(&r, 0)).transpose().map_err(Into::into)
    }

    /// Counts for `/metrics`.
    pub async fn counts(&self) -> Result<CatalogCounts> {
        let r =
            sqlx::query("SELECT COUNT(DISTINCT name), COUNT(*), CAST(COALESCE(SUM(size), 0) AS BIGINT) FROM revisions")
                .fetch_one(&self.pool)
                .await?;
        let files = sqlx::query("SELECT COUNT(*) FROM files").fetch_one(&self.pool).await?;
        Ok(CatalogCounts {
            models: u64_col(&r, 0)?,
            revisions: u64_col(&r, 1)?,
            bytes: u64_col(&r, 2)?,
            files: u64_col(&files, 0)?,
        })
    }
}

fn conflict(name: &str, rev: &str) -> RegistryError {
    RegistryError::Conflict(format!(
        "{name}@{rev} exists already; revisions are immutable (delete it first, or import under another revision)"
    ))
}

/// A `revisions` row (without files) and its id.
fn revision_row(r: &AnyRow) -> Result<(i64, Revision), sqlx::Error> {
    let created_ms: i64 = r.try_get(7)?;
    Ok((
        r.try_get(0)?,
        Revision {
            name: r.try_get(1)?,
            revision: r.try_get(2)?,
            format: r.try_get(3)?,
            license: r.try_get(4)?,
            source: r.try_get(5)?,
            size: u64_col(r, 6)?,
            created: created_ms.div_euclid(1000),
            files: Vec::new(),
        },
    ))
}

fn u64_col(r: &AnyRow, i: usize) -> Result<u64, sqlx::Error> {
    let v: i64 = r.try_get(i)?;
    u64::try_from(v).map_err(|e| sqlx::Error::ColumnDecode { index: i.to_string(), source: Box::new(e) })
}

fn i64_of(v: u64) -> Result<i64> {
    i64::try_from(v).map_err(|_| RegistryError::Internal(format!("size {v} does not fit the catalog")))
}

fn is_unique_violation(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Database(d) => {
            d.is_unique_violation() || d.code().is_some_and(|c| c == "23505" || c == "2067" || c == "1555")
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rev(name: &str, revision: &str, files: &[(&str, u64, char)]) -> Revision {
        let files: Vec<FileEntry> = files
            .iter()
            .map(|(p, s, c)| FileEntry { path: p.to_string(), size: *s, sha256: c.to_string().repeat(64) })
            .collect();
        Revision {
            name: name.into(),
            revision: revision.into(),
            format: "gguf".into(),
            license: Some("apache-2.0".into()),
            created: 0,
            size: files.iter().map(|f| f.size).sum(),
            files,
            source: Some("dir:/x".into()),
        }
    }

    #[tokio::test]
    async fn records_lists_and_deletes_revisions_in_sqlite() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}/sub/registry.db", dir.path().display());
        let c = Catalog::open(&url).await.unwrap();
        assert_eq!(c.backend(), "sqlite");
        assert!(c.list().await.unwrap().is_empty());

        c.insert(&rev("m", "r1", &[("a.gguf", 10, 'a')]), 1_000).await.unwrap();
        c.insert(&rev("m", "r2", &[("a.gguf", 10, 'a'), ("b.json", 2, 'b')]), 2_000).await.unwrap();
        c.insert(&rev("other", "v", &[("c.gguf", 5, 'c')]), 1_500).await.unwrap();
        let e = c.insert(&rev("m", "r1", &[]), 3_000).await.unwrap_err();
        assert!(matches!(e, RegistryError::Conflict(_)), "{e:?}");

        let list = c.list().await.unwrap();
        assert_eq!(list.len(), 2);
        assert_eq!(
            list[0],
            ModelSummary { name: "m".into(), latest: "r2".into(), revisions: vec!["r1".into(), "r2".into()] }
        );
        let latest = c.revision("m", "latest").await.unwrap().unwrap();
        assert_eq!(latest.revision, "r2");
        assert_eq!(latest.size, 12);
        assert_eq!(latest.created, 2);
        assert_eq!(latest.files.iter().map(|f| f.path.as_str()).collect::<Vec<_>>(), ["a.gguf", "b.json"]);
        let m = c.model("m").await.unwrap().unwrap();
        assert_eq!(m.revisions.len(), 2);
        assert!(c.model("absent").await.unwrap().is_none());
        assert_eq!(c.blob_size(&"b".repeat(64)).await.unwrap(), Some(2));
        assert_eq!(c.counts().await.unwrap(), CatalogCounts { models: 2, revisions: 3, files: 4, bytes: 27 });

        // Deleting r2 frees b (and names a, which r1 still holds).
        let freed = c.delete("m", Some("r2")).await.unwrap().unwrap();
        assert_eq!(freed, vec!["a".repeat(64), "b".repeat(64)]);
        assert_eq!(c.blob_size(&"b".repeat(64)).await.unwrap(), None);
        assert_eq!(c.blob_size(&"a".repeat(64)).await.unwrap(), Some(10));
        assert!(c.delete("m", Some("r2")).await.unwrap().is_none());
        assert_eq!(c.delete("m", None).await.unwrap().unwrap(), vec!["a".repeat(64)]);
        assert!(c.model("m").await.unwrap().is_none());

        // Reopening finds the rest (and the migrations already applied).
        drop(c);
        let c = Catalog::open(&url).await.unwrap();
        assert_eq!(c.list().await.unwrap().len(), 1);
    }

    #[test]
    fn database_urls() {
        assert_eq!(backend_of("sqlite::memory:").unwrap(), "sqlite");
        assert_eq!(backend_of("postgresql://u@h/db").unwrap(), "postgres");
        assert!(backend_of("mysql://x").is_err());
        assert_eq!(sqlite_path("sqlite:///var/lib/r.db?mode=rwc"), Some("/var/lib/r.db"));
        assert_eq!(sqlite_path("sqlite::memory:"), None);
    }
}
