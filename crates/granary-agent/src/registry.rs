//! The registry as the agent sees it, through `granary_registry`'s client:
//! revisions, where each file's bytes are, and the list of models.

use granary_registry::client::RegistryClient;
pub use granary_registry::{FileEntry, Revision};

use crate::error::AgentError;

/// The registry client and the agent's reading of its answers.
pub struct Catalog {
    client: RegistryClient,
}

impl Catalog {
    pub fn new(base: &str, token: Option<String>) -> Result<Catalog, AgentError> {
        let client = RegistryClient::new(base, token).map_err(|e| AgentError::Registry(e.to_string()))?;
        Ok(Catalog { client })
    }

    /// `name` at `rev` (`latest` allowed); the registry's 404 becomes
    /// [`AgentError::ModelNotFound`].
    pub async fn revision(&self, name: &str, rev: &str) -> Result<Revision, AgentError> {
        self.client.revision(name, rev).await.map_err(|e| {
            if e.is_not_found() {
                AgentError::ModelNotFound { name: name.into(), revision: rev.into() }
            } else {
                AgentError::Registry(e.to_string())
            }
        })
    }

    /// Where to download a file from, and the bearer token to send there:
    /// the registry's token to the registry itself, none to a presigned URL
    /// (its signature is its credential, and S3 refuses a second one).
    pub async fn file_source(&self, name: &str, rev: &str, path: &str) -> Result<(String, Option<String>), AgentError> {
        let u = self.client.file_url(name, rev, path).await.map_err(|e| AgentError::Registry(e.to_string()))?;
        let own = self.client.is_own(&u.url);
        let bearer = if u.presigned || !own { None } else { self.client.token().map(str::to_string) };
        Ok((u.url, bearer))
    }

    /// The names of the registry's models.
    pub async fn names(&self) -> Result<Vec<String>, AgentError> {
        let list = self.client.list().await.map_err(|e| AgentError::Registry(e.to_string()))?;
        Ok(list.into_iter().map(|m| m.name).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_token_goes_to_the_registrys_origin_only() {
        let base = "http://reg:8400";
        let same_origin = |u: &str, b: &str| RegistryClient::new(b, None).unwrap().is_own(u);
        assert!(same_origin("http://reg:8400/v1/blobs/ab", base));
        assert!(same_origin("http://REG:8400/v1/blobs/ab", base), "host names are case-insensitive");
        assert!(same_origin("https://reg/v1/blobs/ab", "https://reg:443/"), "the default port");
        assert!(!same_origin("http://reg:84001/v1/blobs/ab", base), "a longer port");
        assert!(!same_origin("http://reg:8400.evil.example/x", base));
        assert!(!same_origin("http://reg.evil.example:8400/x", base));
        assert!(!same_origin("https://reg:8400/x", base), "another scheme");
        assert!(!same_origin("http://reg:8400@evil.example/x", base), "userinfo, not a host");
        assert!(!same_origin("not a url", base));
    }
}
