//! Chat templates rendered the way Hugging Face transformers renders them:
//! Jinja with `trim_blocks` and `lstrip_blocks`, loop controls,
//! `raise_exception`, `strftime_now`, a `tojson` that behaves like Python's
//! `json.dumps` (no HTML escaping) and Python string/dict methods.

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{AutoEscape, Environment, Error, ErrorKind};
use serde::Serialize;

use crate::{ChatMessage, Result, TokenizerError};

/// The template used when the model ships none: ChatML, the format of the
/// default model and of most instruction-tuned models without a template.
pub const CHATML_TEMPLATE: &str = "{% for message in messages %}\
{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}\
{% endfor %}\
{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

const NAME: &str = "chat_template";

/// A compiled chat template together with the special-token strings it is
/// rendered with.
pub(crate) struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    is_fallback: bool,
    /// Set when the model's template does not compile: rendering then fails
    /// with this message rather than silently using another format.
    compile_error: Option<String>,
}

/// Variables a request adds to a template's context (vLLM's
/// `chat_template_kwargs`, e.g. Qwen 3's `enable_thinking`).
pub type TemplateKwargs = serde_json::Map<String, serde_json::Value>;

#[derive(Serialize)]
struct Context<'a> {
    /// First, so that a variable of the same name below takes its place:
    /// extra variables never replace the messages, tools or tokens.
    #[serde(flatten)]
    kwargs: Option<&'a TemplateKwargs>,
    messages: &'a [ChatMessage],
    add_generation_prompt: bool,
    bos_token: &'a str,
    eos_token: &'a str,
    unk_token: Option<&'a str>,
    pad_token: Option<&'a str>,
    tools: Option<&'a serde_json::Value>,
    documents: Option<()>,
}

/// Special-token strings a template may refer to.
#[derive(Default, Clone, Copy)]
pub(crate) struct TemplateTokens<'a> {
    pub bos: Option<&'a str>,
    pub eos: Option<&'a str>,
    pub unk: Option<&'a str>,
    pub pad: Option<&'a str>,
}

impl ChatTemplate {
    /// `source` is the model's template; `None` selects ChatML.
    pub(crate) fn new(source: Option<String>) -> Self {
        let (source, is_fallback) = match source {
            Some(s) if !s.trim().is_empty() => (s, false),
            _ => (CHATML_TEMPLATE.to_owned(), true),
        };
        let mut env = hf_environment();
        let compile_error = env.add_template_owned(NAME, source.clone()).err().map(|e| error_message(&e));
        ChatTemplate { env, source, is_fallback, compile_error }
    }

    pub(crate) fn source(&self) -> &str {
        &self.source
    }

    pub(crate) fn is_fallback(&self) -> bool {
        self.is_fallback
    }

    pub(crate) fn render(
        &self,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
        tokens: TemplateTokens<'_>,
        kwargs: Option<&TemplateKwargs>,
    ) -> Result<String> {
        if let Some(e) = &self.compile_error {
            return Err(TokenizerError::Template(e.clone()));
        }
        let tmpl = self.env.get_template(NAME).map_err(|e| TokenizerError::Template(error_message(&e)))?;
        let ctx = Context {
            kwargs,
            messages,
            add_generation_prompt,
            bos_token: tokens.bos.unwrap_or(""),
            eos_token: tokens.eos.unwrap_or(""),
            unk_token: tokens.unk,
            pad_token: tokens.pad,
            tools,
            documents: None,
        };
        tmpl.render(ctx).map_err(|e| TokenizerError::Template(error_message(&e)))
    }
}

fn hf_environment() -> Environment<'static> {
    let mut env = Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_keep_trailing_newline(false);
    env.set_auto_escape_callback(|_| AutoEscape::None);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", strftime_now);
    env.add_filter("tojson", tojson);
    env
}

/// The message of a template error, with the causes minijinja chains to it
/// (a failing `raise_exception` call, for example).
fn error_message(e: &Error) -> String {
    let mut msg = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        msg.push_str(": ");
        msg.push_str(&s.to_string());
        source = s.source();
    }
    msg
}

fn raise_exception(message: String) -> std::result::Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

fn strftime_now(format: String) -> std::result::Result<String, Error> {
    let secs =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs() as i64).unwrap_or(0);
    strftime(&format, secs)
}

/// `time.strftime` for a UTC Unix time, covering the directives chat
/// templates use (dates in system prompts).
pub(crate) fn strftime(format: &str, unix_secs: i64) -> std::result::Result<String, Error> {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"];
    let days = unix_secs.div_euclid(86_400);
    let secs_of_day = unix_secs.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    // 1970-01-01 was a Thursday (index 3 with Monday = 0).
    let weekday = (days + 3).rem_euclid(7) as usize;
    let yday = days - days_from_civil(year, 1, 1) + 1;
    let (hour, minute, second) = (secs_of_day / 3600, secs_of_day / 60 % 60, secs_of_day % 60);

    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let Some(d) = chars.next() else {
            out.push('%');
            break;
        };
        let month_name = MONTHS[(month - 1) as usize];
        let day_name = DAYS[weekday];
        match d {
            'Y' => out.push_str(&year.to_string()),
            'y' => out.push_str(&format!("{:02}", year.rem_euclid(100))),
            'm' => out.push_str(&format!("{month:02}")),
            'd' => out.push_str(&format!("{day:02}")),
            'e' => out.push_str(&format!("{day:2}")),
            '-' => match chars.next() {
                Some('d') => out.push_str(&day.to_string()),
                Some('m') => out.push_str(&month.to_string()),
                Some('H') => out.push_str(&hour.to_string()),
                Some('I') => out.push_str(&((hour + 11) % 12 + 1).to_string()),
                other => {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        format!("strftime_now: unsupported directive %-{}", other.unwrap_or(' ')),
                    ))
                }
            },
            'B' => out.push_str(month_name),
            'b' | 'h' => out.push_str(&month_name[..3]),
            'A' => out.push_str(day_name),
            'a' => out.push_str(&day_name[..3]),
            'j' => out.push_str(&format!("{yday:03}")),
            'H' => out.push_str(&format!("{hour:02}")),
            'I' => out.push_str(&format!("{:02}", (hour + 11) % 12 + 1)),
            'p' => out.push_str(if hour < 12 { "AM" } else { "PM" }),
            'M' => out.push_str(&format!("{minute:02}")),
            'S' => out.push_str(&format!("{second:02}")),
            'F' => out.push_str(&format!("{year}-{month:02}-{day:02}")),
            'T' => out.push_str(&format!("{hour:02}:{minute:02}:{second:02}")),
            'Z' => out.push_str("UTC"),
            'z' => out.push_str("+0000"),
            '%' => out.push('%'),
            other => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("strftime_now: unsupported directive %{other}"),
                ))
            }
        }
    }
    Ok(out)
}

/// Days since 1970-01-01 to (year, month, day), proleptic Gregorian.
fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = if m > 2 { m - 3 } else { m + 9 };
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// `tojson` as transformers defines it: `json.dumps(x, ensure_ascii=False,
/// indent=None, separators=None, sort_keys=False)`, not Jinja's HTML-safe one.
fn tojson(value: &Value, kwargs: Kwargs) -> std::result::Result<Value, Error> {
    let indent: Option<Value> = kwargs.get("indent")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;

    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match (v.as_i64(), v.as_str()) {
            (Some(n), _) => Some(" ".repeat(n.max(0) as usize)),
            (None, Some(s)) => Some(s.to_owned()),
            _ => return Err(Error::new(ErrorKind::InvalidOperation, "tojson: indent must be an integer or a string")),
        },
    };
    let (item_sep, key_sep) = match separators {
        Some(s) if s.len() == 2 => (s[0].clone(), s[1].clone()),
        Some(_) => return Err(Error::new(ErrorKind::InvalidOperation, "tojson: separators must be a pair of strings")),
        None if indent.is_some() => (",".to_owned(), ": ".to_owned()),
        None => (", ".to_owned(), ": ".to_owned()),
    };
    let dumper = PyJson {
        indent,
        item_sep,
        key_sep,
        ensure_ascii: ensure_ascii.unwrap_or(false),
        sort_keys: sort_keys.unwrap_or(false),
    };
    let mut out = String::new();
    dumper.write(value, 0, &mut out)?;
    Ok(Value::from_safe_string(out))
}

struct PyJson {
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    ensure_ascii: bool,
    sort_keys: bool,
}

impl PyJson {
    fn newline(&self, level: usize, out: &mut String) {
        if let Some(ind) = &self.indent {
            out.push('\n');
            for _ in 0..level {
                out.push_str(ind);
            }
        }
    }

    fn write(&self, v: &Value, level: usize, out: &mut String) -> std::result::Result<(), Error> {
        match v.kind() {
            ValueKind::Undefined | ValueKind::None => out.push_str("null"),
            ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
            ValueKind::Number => {
                if v.is_integer() {
                    out.push_str(&v.to_string());
                } else {
                    let f = f64::try_from(v.clone())?;
                    out.push_str(&py_float(f));
                }
            }
            ValueKind::String => self.write_str(v.as_str().unwrap_or_default(), out),
            ValueKind::Map => {
                let mut keys: Vec<Value> = v.try_iter()?.collect();
                if keys.is_empty() {
                    out.push_str("{}");
                    return Ok(());
                }
                if self.sort_keys {
                    keys.sort_by_key(|k| k.to_string());
                }
                out.push('{');
                for (i, k) in keys.iter().enumerate() {
                    if i > 0 {
                        out.push_str(&self.item_sep);
                    }
                    self.newline(level + 1, out);
                    match k.as_str() {
                        Some(s) => self.write_str(s, out),
                        None => self.write_str(&k.to_string(), out),
                    }
                    out.push_str(&self.key_sep);
                    self.write(&v.get_item(k)?, level + 1, out)?;
                }
                self.newline(level, out);
                out.push('}');
            }
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = v.try_iter()?.collect();
                if items.is_empty() {
                    out.push_str("[]");
                    return Ok(());
                }
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(&self.item_sep);
                    }
                    self.newline(level + 1, out);
                    self.write(item, level + 1, out)?;
                }
                self.newline(level, out);
                out.push(']');
            }
            _ => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("tojson: cannot serialize a value of kind {}", v.kind()),
                ))
            }
        }
        Ok(())
    }

    fn write_str(&self, s: &str, out: &mut String) {
        out.push('"');
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{08}' => out.push_str("\\b"),
                '\u{0c}' => out.push_str("\\f"),
                c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
                c if self.ensure_ascii && !c.is_ascii() => {
                    let mut buf = [0u16; 2];
                    for unit in c.encode_utf16(&mut buf) {
                        out.push_str(&format!("\\u{unit:04x}"));
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }
}

/// Python's `repr(float)` for the values JSON can carry.
fn py_float(f: f64) -> String {
    if f.is_nan() {
        return "NaN".to_owned();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.to_owned();
    }
    let abs = f.abs();
    if abs != 0.0 && !(1e-4..1e16).contains(&abs) {
        // Python switches to exponent notation outside [1e-4, 1e16).
        let s = format!("{f:e}");
        let (mantissa, exp) = s.split_once('e').unwrap_or((&s, "0"));
        let exp: i32 = exp.parse().unwrap_or(0);
        return format!("{mantissa}e{}{:02}", if exp < 0 { '-' } else { '+' }, exp.abs());
    }
    let s = f.to_string();
    if s.contains('.') {
        s
    } else {
        format!("{s}.0")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strftime_known_dates() {
        // 2024-02-29T13:05:09Z, a Thursday.
        let t = 1_709_211_909;
        assert_eq!(strftime("%Y-%m-%d %H:%M:%S", t).unwrap(), "2024-02-29 13:05:09");
        assert_eq!(strftime("%d %b %Y", t).unwrap(), "29 Feb 2024");
        assert_eq!(strftime("%A %B %-d, %I %p, day %j", t).unwrap(), "Thursday February 29, 01 PM, day 060");
        assert_eq!(strftime("%d %b %Y", 0).unwrap(), "01 Jan 1970");
    }

    #[test]
    fn tojson_matches_python_json_dumps() {
        let env = hf_environment();
        let render = |src: &str| env.render_str(src, minijinja::context! {}).unwrap();
        assert_eq!(
            render(r#"{{ {"a": 1, "b": [true, none, 1.5, "x<y>\n"], "c": {}} | tojson }}"#),
            r#"{"a": 1, "b": [true, null, 1.5, "x<y>\n"], "c": {}}"#
        );
        assert_eq!(
            render(r#"{{ {"b": 1, "a": [1, 2]} | tojson(indent=2, sort_keys=true) }}"#),
            "{\n  \"a\": [\n    1,\n    2\n  ],\n  \"b\": 1\n}"
        );
        assert_eq!(render(r#"{{ "é😀" | tojson }}"#), "\"é😀\"");
        assert_eq!(render(r#"{{ "é😀" | tojson(ensure_ascii=true) }}"#), r#""\u00e9\ud83d\ude00""#);
        assert_eq!(render(r#"{{ 2.0 | tojson }}"#), "2.0");
    }

    #[test]
    fn python_methods_and_loop_controls() {
        let env = hf_environment();
        let out = env
            .render_str(
                "{% for x in xs %}{% if x == 'skip' %}{% continue %}{% endif %}{{ x.strip().upper() }}{% endfor %}|{{ d.get('k', 'none') }}",
                minijinja::context! { xs => vec!["  a ", "skip", "b"], d => minijinja::context!{} },
            )
            .unwrap();
        assert_eq!(out, "AB|none");
    }

    /// A request's own variables reach the template (Qwen 3's
    /// `enable_thinking`), and never replace the ones the server sets.
    #[test]
    fn request_variables_join_the_context_without_replacing_it() {
        let t = ChatTemplate::new(Some(
            "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}\
             {% if add_generation_prompt %}<assistant>\
             {% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}{% endif %}"
                .into(),
        ));
        let msgs = [ChatMessage::new("user", "hi")];
        let render =
            |kw: serde_json::Value| t.render(&msgs, None, true, TemplateTokens::default(), kw.as_object()).unwrap();
        assert_eq!(render(serde_json::Value::Null), "<user>hi<assistant>");
        assert_eq!(render(serde_json::json!({"enable_thinking": true})), "<user>hi<assistant>");
        assert_eq!(render(serde_json::json!({"enable_thinking": false})), "<user>hi<assistant><think></think>");
        let fixed = serde_json::json!({"messages": [], "add_generation_prompt": false, "enable_thinking": false});
        assert_eq!(render(fixed), "<user>hi<assistant><think></think>");
    }
}
