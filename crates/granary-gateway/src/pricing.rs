//! Spend in currency: per-model prices per million input, cached input and
//! output tokens (`[gateway.prices]`), applied to usage reports.
//!
//! ```toml
//! [gateway.prices]
//! currency = "USD"
//! [gateway.prices.models."llama-3-8b"]
//! input_per_million = 0.10
//! cached_input_per_million = 0.05   # absent: the input price
//! output_per_million = 0.30
//! ```

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// `[gateway.prices]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Prices {
    /// The currency prices are in (a label in reports; `USD` by default).
    pub currency: String,
    /// Prices by model, as clients name it. Usage of a model not listed has
    /// no cost (an empty cell, `null`), never a made-up one.
    pub models: BTreeMap<String, ModelPrice>,
}

impl Default for Prices {
    fn default() -> Self {
        Prices { currency: "USD".into(), models: BTreeMap::new() }
    }
}

/// One model's prices, per million tokens.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelPrice {
    pub input_per_million: f64,
    /// Prompt tokens served from the KV cache (default: the input price).
    #[serde(default)]
    pub cached_input_per_million: Option<f64>,
    pub output_per_million: f64,
}

impl Prices {
    /// What `prompt` tokens (of which `cached` came from the KV cache) and
    /// `completion` tokens of `model` cost; `None` for a model without a price.
    pub fn cost(&self, model: &str, prompt: u64, cached: u64, completion: u64) -> Option<f64> {
        let p = self.models.get(model)?;
        let cached = cached.min(prompt);
        let fresh = (prompt - cached) as f64 * p.input_per_million;
        let reused = cached as f64 * p.cached_input_per_million.unwrap_or(p.input_per_million);
        Some((fresh + reused + completion as f64 * p.output_per_million) / 1e6)
    }

    /// Checks every price is a finite number, 0 or more; the error names the field.
    pub fn validate(&self) -> Result<(), (String, String)> {
        if self.currency.trim().is_empty() {
            return Err(("gateway.prices.currency".into(), "must not be empty".into()));
        }
        for (model, p) in &self.models {
            let fields = [
                ("input_per_million", Some(p.input_per_million)),
                ("cached_input_per_million", p.cached_input_per_million),
                ("output_per_million", Some(p.output_per_million)),
            ];
            for (name, v) in fields {
                if let Some(v) = v.filter(|v| !v.is_finite() || *v < 0.0) {
                    return Err((
                        format!("gateway.prices.models.{model}.{name}"),
                        format!("must be a finite number, 0 or more (not {v})"),
                    ));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn costs_count_cached_input_at_its_own_price() {
        let mut p = Prices::default();
        p.models.insert(
            "m".into(),
            ModelPrice { input_per_million: 2.0, cached_input_per_million: Some(0.5), output_per_million: 8.0 },
        );
        p.models.insert(
            "n".into(),
            ModelPrice { input_per_million: 1.0, cached_input_per_million: None, output_per_million: 1.0 },
        );
        // 600k fresh × 2 + 400k cached × 0.5 + 250k × 8, per million.
        assert_eq!(p.cost("m", 1_000_000, 400_000, 250_000), Some(3.4));
        assert_eq!(p.cost("n", 1_000_000, 1_000_000, 0), Some(1.0), "cached at the input price");
        assert_eq!(p.cost("other", 5, 0, 5), None, "no price, no cost");
    }

    #[test]
    fn prices_parse_and_are_checked() {
        let c = crate::config::GatewayConfig::from_toml(
            "[gateway.prices]\ncurrency = \"EUR\"\n[gateway.prices.models.m]\ninput_per_million = 0.1\noutput_per_million = 0.3\n",
        )
        .unwrap();
        assert_eq!(c.gateway.prices.currency, "EUR");
        assert_eq!(c.gateway.prices.models["m"].cached_input_per_million, None);
        let err = |s: &str| crate::config::GatewayConfig::from_toml(s).unwrap_err().field;
        assert_eq!(
            err("[gateway.prices.models.m]\ninput_per_million = -1.0\noutput_per_million = 0.3\n"),
            "gateway.prices.models.m.input_per_million"
        );
        assert_eq!(err("[gateway.prices.models.m]\ninput_per_million = 1.0\n"), "gateway.prices.models.m");
    }
}
