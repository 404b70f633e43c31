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
//!
//! Budgets in currency (`spend_per_day`, `spend_per_month` in a tenant's or
//! key's limits) count [`Money`]: whole micro-units of the currency, each
//! request's cost rounded up to the next micro-unit.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// An amount of the configured currency, held as whole micro-units
/// (millionths) so counters add exactly. Written and read as a plain
/// decimal number of currency units (`12.5`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Money(pub u64);

impl Money {
    /// Micro-units per currency unit.
    pub const MICROS: f64 = 1e6;

    /// `units` of the currency, rounded up to whole micro-units; `None`
    /// unless finite and 0 or more.
    pub fn from_units(units: f64) -> Option<Money> {
        if !units.is_finite() || units < 0.0 || units * Self::MICROS >= u64::MAX as f64 {
            return None;
        }
        // Rounding noise below a thousandth of a micro-unit is not a micro-unit.
        Some(Money((units * Self::MICROS - 1e-3).ceil().max(0.0) as u64))
    }

    /// The amount in currency units.
    pub fn units(self) -> f64 {
        self.0 as f64 / Self::MICROS
    }
}

impl std::fmt::Display for Money {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let text = format!("{}.{:06}", self.0 / 1_000_000, self.0 % 1_000_000);
        let text = text.trim_end_matches('0');
        f.write_str(text.strip_suffix('.').unwrap_or(text))
    }
}

impl std::str::FromStr for Money {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let units: f64 = s.trim().parse().map_err(|_| format!("{s:?} is not a number"))?;
        Money::from_units(units).ok_or_else(|| format!("{s:?} must be a finite number, 0 or more"))
    }
}

impl Serialize for Money {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_f64(self.units())
    }
}

impl<'de> Deserialize<'de> for Money {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let units = f64::deserialize(d)?;
        Money::from_units(units).ok_or_else(|| {
            serde::de::Error::custom(format!("an amount of currency must be a finite number, 0 or more (not {units})"))
        })
    }
}

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

    /// What `prompt` tokens (of which `cached` came from the KV cache) and
    /// `completion` tokens of `model` cost, rounded up to whole micro-units;
    /// nothing for a model without a price.
    pub fn spend(&self, model: &str, prompt: u64, cached: u64, completion: u64) -> Money {
        self.cost(model, prompt, cached, completion).and_then(Money::from_units).unwrap_or_default()
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
    fn money_rounds_up_to_micro_units_and_reads_as_units() {
        assert_eq!(Money::from_units(12.5), Some(Money(12_500_000)));
        assert_eq!(Money::from_units(0.0000001), Some(Money(1)), "a part of a micro-unit is one");
        assert_eq!(Money::from_units(0.3), Some(Money(300_000)), "float noise is not rounded up");
        assert_eq!(Money::from_units(-1.0), None);
        assert_eq!(Money::from_units(f64::NAN), None);
        assert_eq!(Money(12_500_000).to_string(), "12.5");
        assert_eq!(Money(3).to_string(), "0.000003");
        assert_eq!(Money(2_000_000).to_string(), "2");
        let m: Money = serde_json::from_str("0.25").unwrap();
        assert_eq!(m, Money(250_000));
        assert_eq!(serde_json::to_string(&m).unwrap(), "0.25");
        let err = serde_json::from_str::<Money>("-3").unwrap_err().to_string();
        assert!(err.contains("0 or more"), "{err}");
        let mut p = Prices::default();
        p.models.insert(
            "m".into(),
            ModelPrice { input_per_million: 0.1, cached_input_per_million: None, output_per_million: 0.3 },
        );
        // 10 × 0.1 + 10 × 0.3 per million = 4e-6: four micro-units.
        assert_eq!(p.spend("m", 10, 0, 10), Money(4));
        assert_eq!(p.spend("m", 1, 0, 0), Money(1), "rounded up");
        assert_eq!(p.spend("other", 1000, 0, 1000), Money(0), "no price, no spend");
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
