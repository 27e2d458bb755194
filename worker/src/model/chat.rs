//! Chat template rendering: the GGUF's `tokenizer.chat_template` (Jinja) rendered with minijinja 2 the way
//! Hugging Face's `apply_chat_template` does (trim_blocks, lstrip_blocks, loop controls, `raise_exception`,
//! `bos_token` / `eos_token` / `messages` / `add_generation_prompt`, and the common Python string methods).

use minijinja::value::{Value, ValueKind};
use minijinja::{Environment, Error, ErrorKind, State};
use serde::{Deserialize, Serialize};

use super::error::ModelError;
use super::gguf::Gguf;

const TEMPLATE_NAME: &str = "chat";

/// Instructions one render may execute. The template comes from the model file and runs on every chat request, so a
/// loop nested over the messages must end in an error, not hours of CPU. Real templates take tens to a few hundred
/// instructions per message (SmolLM2's ~20); this allows thousands for each of 1,024 messages and stops a runaway
/// template within a fraction of a second.
pub const RENDER_FUEL: u64 = 5_000_000;
/// Rendered bytes allowed beyond [`RENDER_BYTES_PER_INPUT_BYTE`] times the messages' own: the template's text.
pub const RENDER_BASE_BYTES: usize = 1 << 20;
/// A template writes each message once, with some markup; a rendering several times larger than its input is a
/// template repeating it (1,024 messages of 1 MiB in a nested loop would be a terabyte), refused before it is built.
pub const RENDER_BYTES_PER_INPUT_BYTE: usize = 4;

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, ...
    pub role: String,
    /// The message text.
    pub content: String,
}

impl ChatMessage {
    /// Convenience constructor.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> ChatMessage {
        ChatMessage { role: role.into(), content: content.into() }
    }
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").field("bos_token", &self.bos_token).field("eos_token", &self.eos_token).finish()
    }
}

fn template_err(e: Error) -> ModelError {
    let mut msg = e.to_string();
    let mut src = std::error::Error::source(&e);
    while let Some(s) = src {
        msg.push_str(": ");
        msg.push_str(&s.to_string());
        src = s.source();
    }
    ModelError::Template(msg)
}

fn raise_exception(msg: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg))
}

/// UTC calendar date and time of day of `secs` seconds since 1970-01-01: (year, month 1-12, day 1-31, seconds into
/// the day), by the proleptic Gregorian calendar (Howard Hinnant's days-to-civil).
pub fn civil_utc(secs: i64) -> (i64, i64, i64, i64) {
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    (yoe + era * 400 + i64::from(month <= 2), month, day, rem)
}

/// `strftime_now(fmt)` as HF provides it, in UTC, for the directives chat templates use
/// (`%Y %y %m %d %e %B %b %H %M %S %%`).
fn strftime_now(fmt: &str) -> String {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs()) as i64;
    let (year, month, day, rem) = civil_utc(secs);
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
    let name = MONTHS[(month - 1).clamp(0, 11) as usize];
    let mut out = String::new();
    let mut it = fmt.chars();
    while let Some(c) = it.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match it.next() {
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year.rem_euclid(100))),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('e') => out.push_str(&format!("{day:>2}")),
            Some('B') => out.push_str(name),
            Some('b') => out.push_str(&name[..3]),
            Some('H') => out.push_str(&format!("{:02}", rem / 3600)),
            Some('M') => out.push_str(&format!("{:02}", rem / 60 % 60)),
            Some('S') => out.push_str(&format!("{:02}", rem % 60)),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// Python `str` / `dict` methods that chat templates call and minijinja lacks.
fn python_methods(_state: &State, value: &Value, method: &str, args: &[Value]) -> Result<Value, Error> {
    let arg_str = |i: usize| -> Result<Option<String>, Error> {
        match args.get(i) {
            None => Ok(None),
            Some(v) if v.is_none() => Ok(None),
            Some(v) => match v.as_str() {
                Some(s) => Ok(Some(s.to_string())),
                None => Err(Error::new(ErrorKind::InvalidOperation, format!("{method}: expected a string argument"))),
            },
        }
    };
    if let Some(s) = value.as_str() {
        let chars = if matches!(method, "strip" | "lstrip" | "rstrip" | "split") { arg_str(0)? } else { None };
        let strip_set = |c: char| chars.as_deref().map_or(c.is_whitespace(), |set| set.contains(c));
        return Ok(match method {
            "strip" => Value::from(s.trim_matches(strip_set)),
            "lstrip" => Value::from(s.trim_start_matches(strip_set)),
            "rstrip" => Value::from(s.trim_end_matches(strip_set)),
            "upper" => Value::from(s.to_uppercase()),
            "lower" => Value::from(s.to_lowercase()),
            "title" => {
                let mut out = String::with_capacity(s.len());
                let mut prev_alpha = false;
                for c in s.chars() {
                    if prev_alpha {
                        out.extend(c.to_lowercase())
                    } else {
                        out.extend(c.to_uppercase())
                    }
                    prev_alpha = c.is_alphabetic();
                }
                Value::from(out)
            }
            "capitalize" => {
                let mut cs = s.chars();
                match cs.next() {
                    Some(f) => Value::from(f.to_uppercase().chain(cs.flat_map(char::to_lowercase)).collect::<String>()),
                    None => Value::from(""),
                }
            }
            "startswith" | "endswith" => {
                let needles: Vec<String> = match args.first() {
                    Some(v) if v.kind() == ValueKind::Seq => {
                        v.try_iter()?.filter_map(|x| x.as_str().map(str::to_string)).collect()
                    }
                    _ => arg_str(0)?.into_iter().collect(),
                };
                let hit =
                    needles.iter().any(|n| if method == "startswith" { s.starts_with(n) } else { s.ends_with(n) });
                Value::from(hit)
            }
            "split" => {
                let parts: Vec<Value> = match chars {
                    Some(sep) if !sep.is_empty() => s.split(sep.as_str()).map(Value::from).collect(),
                    _ => s.split_whitespace().map(Value::from).collect(),
                };
                Value::from(parts)
            }
            "replace" => {
                let (Some(from), Some(to)) = (arg_str(0)?, arg_str(1)?) else {
                    return Err(Error::new(ErrorKind::MissingArgument, "replace needs two arguments"));
                };
                Value::from(s.replace(&from, &to))
            }
            "find" => {
                let needle = arg_str(0)?.unwrap_or_default();
                Value::from(s.find(&needle).map_or(-1, |i| s[..i].chars().count() as i64))
            }
            _ => return Err(Error::from(ErrorKind::UnknownMethod)),
        });
    }
    if value.kind() == ValueKind::Map {
        return match method {
            "items" => {
                let mut out = Vec::new();
                for k in value.try_iter()? {
                    let v = value.get_item(&k)?;
                    out.push(Value::from(vec![k, v]));
                }
                Ok(Value::from(out))
            }
            "keys" => Ok(Value::from(value.try_iter()?.collect::<Vec<_>>())),
            "values" => {
                let mut out = Vec::new();
                for k in value.try_iter()? {
                    out.push(value.get_item(&k)?);
                }
                Ok(Value::from(out))
            }
            "get" => {
                let key = args.first().cloned().unwrap_or(Value::UNDEFINED);
                let v = value.get_item(&key)?;
                Ok(if v.is_undefined() { args.get(1).cloned().unwrap_or(Value::from(())) } else { v })
            }
            _ => Err(Error::from(ErrorKind::UnknownMethod)),
        };
    }
    Err(Error::from(ErrorKind::UnknownMethod))
}

/// The rendering's buffer, which fails the write that would take it past `limit` bytes, so that an oversized
/// rendering stops there rather than being built and then refused.
struct BoundedWriter {
    bytes: Vec<u8>,
    limit: usize,
    exceeded: bool,
}

impl std::io::Write for BoundedWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.bytes.len().saturating_add(buf.len()) > self.limit {
            self.exceeded = true;
            return Err(std::io::Error::other("rendered prompt too long"));
        }
        self.bytes.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl ChatTemplate {
    /// Compiles a template with the given special-token texts.
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<ChatTemplate, ModelError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", |fmt: String| -> Value { Value::from(strftime_now(&fmt)) });
        env.set_unknown_method_callback(python_methods);
        env.set_fuel(Some(RENDER_FUEL));
        env.add_template_owned(TEMPLATE_NAME, source.to_string()).map_err(template_err)?;
        Ok(ChatTemplate { env, bos_token: bos_token.to_string(), eos_token: eos_token.to_string() })
    }

    /// The template from `tokenizer.chat_template`, with `bos_token` / `eos_token` the texts of the GGUF's
    /// bos/eos ids.
    pub fn from_gguf(g: &Gguf) -> Result<ChatTemplate, ModelError> {
        let source = g.get_str("tokenizer.chat_template")?;
        let tokens = g.get_str_array("tokenizer.ggml.tokens")?;
        let text_of = |key: &str| -> Result<String, ModelError> {
            match g.get_u32_opt(key)? {
                None => Ok(String::new()),
                Some(id) => tokens
                    .get(id as usize)
                    .map(|s| s.to_string())
                    .ok_or_else(|| ModelError::bad_meta(key, format!("token id {id} is out of range"))),
            }
        };
        let bos = text_of("tokenizer.ggml.bos_token_id")?;
        let eos = text_of("tokenizer.ggml.eos_token_id")?;
        ChatTemplate::new(source, &bos, &eos)
    }

    /// Renders the conversation; `add_generation_prompt` appends the assistant turn header. A template that runs
    /// past [`RENDER_FUEL`] instructions or writes more than [`ChatTemplate::render_limit`] bytes is an error.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String, ModelError> {
        let tmpl = self.env.get_template(TEMPLATE_NAME).map_err(template_err)?;
        let ctx = minijinja::context! {
            messages => Value::from_serialize(messages),
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.as_str(),
            eos_token => self.eos_token.as_str(),
        };
        let limit = Self::render_limit(messages);
        let mut out = BoundedWriter { bytes: Vec::new(), limit, exceeded: false };
        if let Err(e) = tmpl.render_captured_to(ctx, &mut out) {
            if out.exceeded {
                return Err(ModelError::Template(format!(
                    "the rendered prompt exceeds {limit} bytes (the template repeats its input)"
                )));
            }
            if e.kind() == ErrorKind::OutOfFuel {
                return Err(ModelError::Template(format!(
                    "rendering took more than {RENDER_FUEL} template instructions"
                )));
            }
            return Err(template_err(e));
        }
        String::from_utf8(out.bytes).map_err(|_| ModelError::Template("the rendered prompt is not UTF-8".into()))
    }

    /// Most bytes a rendering of `messages` may take: [`RENDER_BASE_BYTES`] plus [`RENDER_BYTES_PER_INPUT_BYTE`]
    /// times their roles and contents.
    pub fn render_limit(messages: &[ChatMessage]) -> usize {
        let input: usize = messages.iter().map(|m| m.role.len().saturating_add(m.content.len())).sum();
        input.saturating_mul(RENDER_BYTES_PER_INPUT_BYTE).saturating_add(RENDER_BASE_BYTES)
    }

    /// The `bos_token` text given to the template.
    pub fn bos_token(&self) -> &str {
        &self.bos_token
    }

    /// The `eos_token` text given to the template.
    pub fn eos_token(&self) -> &str {
        &self.eos_token
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_and_raises() {
        let t = ChatTemplate::new(
            "{% for m in messages %}{% if m.role == 'bad' %}{{ raise_exception('no ' + m.role) }}{% endif %}\
             {{ bos_token }}{{ m.role.upper() }}:{{ m['content'].strip() }}{{ eos_token }}\n{% endfor %}\
             {% if add_generation_prompt %}A:{% endif %}",
            "<s>",
            "</s>",
        )
        .unwrap();
        let out = t.render(&[ChatMessage::new("user", "  hi  ")], true).unwrap();
        assert_eq!(out, "<s>USER:hi</s>\nA:");
        let err = t.render(&[ChatMessage::new("bad", "x")], false).unwrap_err();
        assert!(err.to_string().contains("no bad"), "{err}");
    }

    fn smollm2() -> ChatTemplate {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/SmolLM2-135M-Instruct.Q4_1.gguf");
        let path = std::env::var_os("PAGODA_MODEL").map_or(path, Into::into);
        ChatTemplate::from_gguf(&Gguf::open(&path).expect("open model (set PAGODA_MODEL)")).unwrap()
    }

    #[test]
    fn a_template_repeating_its_input_is_stopped_at_the_output_limit() {
        let t = ChatTemplate::new(
            "{% for a in messages %}{% for b in messages %}{{ b.content }}{% endfor %}{% endfor %}",
            "",
            "",
        )
        .unwrap();
        // 128 × 128 × 32 KiB would be 512 MiB, from 4 MiB of messages.
        let messages = vec![ChatMessage::new("user", "x".repeat(32 << 10)); 128];
        let started = std::time::Instant::now();
        let err = t.render(&messages, false).unwrap_err().to_string();
        assert!(err.contains("rendered prompt exceeds"), "{err}");
        assert!(started.elapsed() < std::time::Duration::from_secs(5));
    }

    #[test]
    fn a_template_looping_without_output_runs_out_of_fuel() {
        let t = ChatTemplate::new(
            "{% for a in messages %}{% for b in messages %}{% for c in messages %}{% endfor %}{% endfor %}{% endfor %}",
            "",
            "",
        )
        .unwrap();
        let messages = vec![ChatMessage::new("user", "x"); 256];
        let err = t.render(&messages, false).unwrap_err().to_string();
        assert!(err.contains("template instructions"), "{err}");
    }

    #[test]
    fn the_real_template_renders_a_long_conversation_within_the_limits() {
        let t = smollm2();
        let messages: Vec<ChatMessage> = (0..1024)
            .map(|i| ChatMessage::new(if i % 2 == 0 { "user" } else { "assistant" }, format!("turn {i} ").repeat(500)))
            .collect();
        let out = t.render(&messages, true).unwrap();
        assert!(out.starts_with("<|im_start|>system\n") && out.ends_with("<|im_start|>assistant\n"));
        assert!(out.contains("turn 1023 turn 1023"));
    }

    #[test]
    fn syntax_error_is_an_error() {
        assert!(matches!(ChatTemplate::new("{% for %}", "", ""), Err(ModelError::Template(_))));
    }

    #[test]
    fn python_string_methods() {
        let t = ChatTemplate::new(
            "{{ 'a,b'.split(',')|join('|') }} {{ 'xhix'.strip('x') }} {{ 'abc'.startswith('ab') }} \
             {{ 'abc'.endswith(('z', 'c')) }} {{ 'a-b'.replace('-', '+') }} {{ {'k': 1}.get('k') }} \
             {{ {'k': 1}.get('z', 2) }} {{ 'hello world'.title() }}",
            "",
            "",
        )
        .unwrap();
        assert_eq!(t.render(&[], false).unwrap(), "a|b hi True True a+b 1 2 Hello World");
    }
}
