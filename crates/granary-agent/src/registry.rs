//! TEMPORARY: the registry protocol per the contract, until granary-registry's client is merged.

use serde::Deserialize;

use crate::error::AgentError;

#[derive(Debug, Clone, Deserialize)]
pub struct FileEntry {
    pub path: String,
    pub size: u64,
    pub sha256: String,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Revision {
    pub name: String,
    pub revision: String,
    pub format: String,
    pub files: Vec<FileEntry>,
}

pub struct Catalog {
    base: String,
    token: Option<String>,
    http: reqwest::Client,
}

impl Catalog {
    pub fn new(base: &str, token: Option<String>) -> Result<Catalog, AgentError> {
        Ok(Catalog { base: base.trim_end_matches('/').into(), token, http: reqwest::Client::new() })
    }

    fn get(&self, path: &str) -> reqwest::RequestBuilder {
        let r = self.http.get(format!("{}{path}", self.base));
        match &self.token {
            Some(t) => r.bearer_auth(t),
            None => r,
        }
    }

    pub async fn revision(&self, name: &str, rev: &str) -> Result<Revision, AgentError> {
        let r = self
            .get(&format!("/v1/models/{name}/revisions/{rev}"))
            .send()
            .await
            .map_err(|e| AgentError::Registry(e.to_string()))?;
        if r.status() == 404 {
            return Err(AgentError::ModelNotFound { name: name.into(), revision: rev.into() });
        }
        if !r.status().is_success() {
            return Err(AgentError::Registry(format!("HTTP {}", r.status())));
        }
        r.json().await.map_err(|e| AgentError::Registry(e.to_string()))
    }

    pub async fn file_source(
        &self,
        _name: &str,
        _rev: &str,
        _path: &str,
        sha256: &str,
    ) -> Result<(String, Option<String>), AgentError> {
        Ok((format!("{}/v1/blobs/{sha256}", self.base), self.token.clone()))
    }

    pub async fn names(&self) -> Result<Vec<String>, AgentError> {
        #[derive(Deserialize)]
        struct L {
            models: Vec<M>,
        }
        #[derive(Deserialize)]
        struct M {
            name: String,
        }
        let r = self.get("/v1/models").send().await.map_err(|e| AgentError::Registry(e.to_string()))?;
        let l: L = r.json().await.map_err(|e| AgentError::Registry(e.to_string()))?;
        Ok(l.models.into_iter().map(|m| m.name).collect())
    }
}
