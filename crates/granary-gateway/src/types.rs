//! The vocabulary the gateway's parts share: who is calling, and what they
//! may spend.

use serde::{Deserialize, Serialize};

/// A tenant's id (database key).
pub type TenantId = i64;
/// An API key's id (database key; never the secret).
pub type KeyId = i64;

/// Spending limits; `None` is unlimited. Set per tenant and per key: a
/// request must fit both.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Limits {
    /// Requests admitted per minute.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requests_per_minute: Option<u64>,
    /// Tokens (prompt + completion) per minute.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_per_minute: Option<u64>,
    /// Tokens per UTC day.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_per_day: Option<u64>,
    /// Tokens per UTC calendar month.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_per_month: Option<u64>,
    /// Spend per UTC day, in the currency of `[gateway.prices]` (cost of
    /// the tokens at the model's price; a model without a price costs nothing).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spend_per_day: Option<crate::pricing::Money>,
    /// Spend per UTC calendar month, in the currency of `[gateway.prices]`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spend_per_month: Option<crate::pricing::Money>,
}

impl Limits {
    pub fn is_unlimited(&self) -> bool {
        *self == Limits::default()
    }
}

/// How long a request may wait for capacity when every upstream is busy:
/// premium requests are admitted before standard ones, standard before batch.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Priority {
    Batch = 0,
    #[default]
    Standard = 1,
    Premium = 2,
}

impl Priority {
    pub const ALL: [Priority; 3] = [Priority::Batch, Priority::Standard, Priority::Premium];

    pub fn as_str(self) -> &'static str {
        match self {
            Priority::Batch => "batch",
            Priority::Standard => "standard",
            Priority::Premium => "premium",
        }
    }
}

impl std::str::FromStr for Priority {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "batch" => Ok(Priority::Batch),
            "standard" => Ok(Priority::Standard),
            "premium" => Ok(Priority::Premium),
            _ => Err(format!("unknown priority {s:?} (batch, standard or premium)")),
        }
    }
}

/// Who a request comes from, as its API key says. Built only by
/// [`crate::identity`] from a key it verified; nothing a client sends
/// (headers, body fields) can change it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Principal {
    pub key_id: KeyId,
    /// The key's public prefix (shown in listings and logs; not secret).
    pub key_prefix: String,
    pub tenant_id: TenantId,
    pub tenant: String,
    /// The KV namespace the tenant's requests run in (the tenant's name
    /// unless the tenant opted into a shared one).
    pub namespace: String,
    /// Models the key may use; `None` is every model.
    pub models: Option<Vec<String>>,
    /// The tenant's priority tier.
    pub priority: Priority,
    pub key_limits: Limits,
    pub tenant_limits: Limits,
    /// Whether audit records of this tenant keep the prompt text.
    pub log_prompts: bool,
}

impl Principal {
    pub fn may_use(&self, model: &str) -> bool {
        self.models.as_ref().is_none_or(|m| m.iter().any(|x| x == model))
    }
}

/// Now, in unix milliseconds: the one clock of records, limits and agents.
pub fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}
