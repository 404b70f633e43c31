//! Validation of the fields both endpoints share: ranges, the sampling
//! fields, stop strings and vLLM's stopping fields.

use super::*;

impl Shared {
    pub(super) fn validate(self, model: String, input: Input) -> Result<Validated, ApiError> {
        let grammar = self.extra.format.validate()?;
        let n = self.n.unwrap_or(1);
        if !(1..=MAX_N).contains(&n) {
            return Err(out_of_range("n", n as f64, "between 1 and 8"));
        }
        if let Some(t) = self.temperature {
            if !(0.0..=2.0).contains(&t) {
                return Err(out_of_range("temperature", t, "between 0 and 2"));
            }
        }
        if let Some(p) = self.top_p {
            if !(p > 0.0 && p <= 1.0) {
                return Err(out_of_range("top_p", p, "greater than 0 and at most 1"));
            }
        }
        // vLLM's convention: -1 (or 0) disables top_k.
        let top_k = match self.extra.top_k {
            Some(k) if k < -1 => return Err(out_of_range("top_k", k as f64, "-1 (off), 0 (off) or a positive count")),
            Some(k) => Some(k.max(0) as usize),
            None => None,
        };
        if let Some(p) = self.extra.min_p {
            if !(0.0..=1.0).contains(&p) {
                return Err(out_of_range("min_p", p, "between 0 and 1"));
            }
        }
        if let Some(r) = self.extra.repetition_penalty {
            if !(r > 0.0 && r <= 2.0) {
                return Err(out_of_range("repetition_penalty", r, "greater than 0 and at most 2"));
            }
        }
        for (param, value) in
            [("presence_penalty", self.presence_penalty), ("frequency_penalty", self.frequency_penalty)]
        {
            let Some(v) = value else { continue };
            if !(-2.0..=2.0).contains(&v) {
                return Err(out_of_range(param, v, "between -2 and 2"));
            }
        }
        let mut logit_bias = Vec::new();
        for (k, &v) in self.extra.logit_bias.iter().flatten() {
            let param = format!("logit_bias.{k}");
            let Ok(id) = k.parse::<u32>() else {
                return Err(ApiError::invalid(
                    &param,
                    "invalid_value",
                    format!("Invalid value for `{param}`: `{k}` is not a token id."),
                ));
            };
            if !(-100.0..=100.0).contains(&v) {
                return Err(out_of_range(&param, v, "between -100 and 100"));
            }
            logit_bias.push((id, v as f32));
        }
        let priority = match self.extra.priority {
            Some(p) => i32::try_from(p)
                .map_err(|_| out_of_range("priority", p as f64, "between -2147483648 and 2147483647"))?,
            None => 0,
        };
        let stop = self.stop.map(|s| s.0).unwrap_or_default();
        if stop.len() > MAX_STOP_SEQUENCES {
            return Err(ApiError::invalid(
                "stop",
                "invalid_value",
                format!(
                    "Invalid value for `stop`: at most {MAX_STOP_SEQUENCES} sequences are allowed, got {}.",
                    stop.len()
                ),
            ));
        }
        let stop = stop.into_iter().filter(|s| !s.is_empty()).collect();
        let min_tokens = self.extra.min_tokens.unwrap_or(0);
        if let Some(max) = self.max_tokens.filter(|m| min_tokens > m.value as u64) {
            return Err(ApiError::invalid(
                "min_tokens",
                "invalid_value",
                format!(
                    "Invalid value for `min_tokens`: it must be at most `{}` ({}), got {min_tokens}.",
                    max.param, max.value
                ),
            ));
        }
        refuse_if(
            min_tokens > 0 && grammar.is_some(),
            "min_tokens",
            "it cannot be combined with structured outputs, whose grammar decides where the answer ends.",
        )?;
        let text = TextRules {
            stop,
            include_stop: self.extra.include_stop_str_in_output.unwrap_or(false),
            min_tokens: usize::try_from(min_tokens).unwrap_or(usize::MAX),
            keep_special: !self.extra.skip_special_tokens.unwrap_or(true),
        };
        Ok(Validated {
            model,
            input,
            max_tokens: self.max_tokens,
            sampling: SamplingRequest {
                temperature: self.temperature.map(|t| t as f32),
                top_p: self.top_p.map(|p| p as f32),
                top_k,
                min_p: self.extra.min_p.map(|p| p as f32),
                presence_penalty: self.presence_penalty.unwrap_or(0.0) as f32,
                frequency_penalty: self.frequency_penalty.unwrap_or(0.0) as f32,
                repetition_penalty: self.extra.repetition_penalty.map(|r| r as f32),
                logit_bias,
                seed: self.seed.map(|s| s.0),
                logprobs: self.logprobs,
            },
            text,
            stop_token_ids: self.extra.stop_token_ids.unwrap_or_default(),
            stream: self.stream.unwrap_or(false),
            include_usage: self.stream_options.and_then(|o| o.include_usage).unwrap_or(false),
            echo: false,
            batch: Vec::new(),
            chat: ChatRender::default(),
            n: n as usize,
            best_of: n as usize,
            grammar,
            tools: None,
            priority,
            ignore_eos: self.extra.ignore_eos.unwrap_or(false),
        })
    }
}
