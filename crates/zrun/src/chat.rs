//! Chat templates for `zrun sample --chat`: an instruction-tuned model
//! (Qwen2.5-Instruct, Llama-3-Instruct, Qwen3…) answers well only when its
//! prompt is laid out as in its tuning, with its role markers and special
//! tokens. That layout is a Jinja template shipped with the model
//! (`chat_template.jinja`, or the `chat_template` of
//! `tokenizer_config.json`), which `transformers`' `apply_chat_template`
//! renders. This renders it the same way: minijinja with `trim_blocks` and
//! `lstrip_blocks`, loop controls, Python's string methods (pycompat), the
//! same variables (`messages`, each message's reasoning under the names
//! templates read, `add_generation_prompt`, the special tokens, `tools`
//! where given, `documents` none) and the same helpers (`raise_exception`,
//! `strftime_now`, a `tojson` that writes as Python's `json.dumps` with
//! `ensure_ascii=False`). The text it gives is then tokenized without
//! special tokens added, as `apply_chat_template(tokenize=True)` does: the
//! template wrote the ones the model wants.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Environment, Error, ErrorKind, Value};

use crate::Failure;

/// The file `save_pretrained` writes a model's chat template to.
const TEMPLATE_FILE: &str = "chat_template.jinja";
/// The compiled template's name in its environment (minijinja's errors
/// end with it; zrun's name the file first).
const COMPILED: &str = "template";
/// The same template with its `{% generation %}` blocks marked.
const COMPILED_MARKED: &str = "template with the assistant's blocks marked";
/// What a `{% generation %}` block's start and end write in the marked
/// template: characters of Unicode's private use area, which no published
/// template or tokenizer gives a meaning.
const MARKS: [char; 2] = ['\u{E000}', '\u{E001}'];
/// The older file of a processor's template: `{"chat_template": "..."}`.
const TEMPLATE_JSON: &str = "chat_template.json";
/// The tokenizer's settings: a `chat_template` (a string, or a list of
/// named ones) and the special tokens the template may write.
const TOKENIZER_CONFIG: &str = "tokenizer_config.json";
/// The special tokens `apply_chat_template` gives a template, by the names
/// it gives them.
const SPECIAL_TOKENS: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

/// A model's chat template with the special tokens of its tokenizer.
#[derive(Debug, Clone)]
pub struct ChatTemplate {
    /// Its text, `{% generation %}` blocks made plain Jinja.
    source: String,
    /// Where it has `{% generation %}` blocks: its text with each block's
    /// start and end writing [`MARKS`].
    marked: Option<String>,
    /// Where it was read (errors name it).
    from: PathBuf,
    /// `bos_token` … as `tokenizer_config.json` says them.
    specials: BTreeMap<String, String>,
}

impl ChatTemplate {
    /// The template of `file` if given, else the model's in `dir`:
    /// `chat_template.jinja`, then `chat_template.json`, then the
    /// `chat_template` of `tokenizer_config.json` (of a list of named
    /// templates, the one named `default`), as `transformers` looks; none
    /// where `dir` has none. The special tokens come from `dir`'s
    /// `tokenizer_config.json` either way. Unreadable or malformed: exit 2
    /// naming the file.
    pub fn find(file: Option<&Path>, dir: Option<&Path>) -> anyhow::Result<Option<ChatTemplate>> {
        let config = match dir.map(|d| d.join(TOKENIZER_CONFIG)) {
            Some(path) if path.is_file() => Some((read_json(&path)?, path)),
            _ => None,
        };
        let specials = match &config {
            Some((json, path)) => special_tokens(json, path)?,
            None => BTreeMap::new(),
        };
        let found = |source: String, from: PathBuf| {
            let plain = without_generation_tags(&source, false);
            Some(ChatTemplate {
                marked: (plain != source).then(|| without_generation_tags(&source, true)),
                source: plain,
                from,
                specials: specials.clone(),
            })
        };
        if let Some(file) = file {
            let source = std::fs::read_to_string(file).map_err(|e| {
                Failure::bad_input(format!("--chat-template {}: {e}", file.display()))
            })?;
            return Ok(found(source, file.to_path_buf()));
        }
        let Some(dir) = dir else {
            return Ok(None);
        };
        let jinja = dir.join(TEMPLATE_FILE);
        if jinja.is_file() {
            let source = std::fs::read_to_string(&jinja)
                .map_err(|e| Failure::bad_input(format!("{}: {e}", jinja.display())))?;
            return Ok(found(source, jinja));
        }
        let json = dir.join(TEMPLATE_JSON);
        if json.is_file() {
            let source = template_in(&read_json(&json)?, &json)?.ok_or_else(|| {
                Failure::bad_input(format!("{}: no `chat_template` in it", json.display()))
            })?;
            return Ok(found(source, json));
        }
        match &config {
            Some((config, path)) => {
                Ok(template_in(config, path)?.and_then(|t| found(t, path.clone())))
            }
            None => Ok(None),
        }
    }

    /// Where [`ChatTemplate::find`] looks in `dir`, for an error that
    /// found none there.
    pub fn looked_in(dir: &Path) -> String {
        format!(
            "{} has no chat template ({TEMPLATE_FILE}, {TEMPLATE_JSON}, or a `chat_template` in {TOKENIZER_CONFIG})",
            dir.display()
        )
    }

    /// Where the template was read.
    pub fn path(&self) -> &Path {
        &self.from
    }

    /// The prompt that asks for the assistant's reply
    /// (`add_generation_prompt`) to the user's `prompt`, after the system
    /// message `system` (if any) and the conversation so far, `earlier`
    /// (messages as a JSON file gives them, every key kept), with `extra`
    /// variables (`enable_thinking` …) besides. An error of the template
    /// (its syntax, or its own `raise_exception`) is exit 2 naming the file
    /// and line.
    pub fn render(
        &self,
        system: Option<&str>,
        earlier: Vec<Value>,
        prompt: &str,
        extra: &[(String, Value)],
    ) -> anyhow::Result<String> {
        let message = |role: &str, content: &str| {
            map_of([
                ("role", Value::from(role)),
                ("content", Value::from(content)),
            ])
        };
        let messages: Vec<Value> = (system.map(|s| message("system", s)).into_iter())
            .chain(earlier)
            .chain([message("user", prompt)])
            .collect();
        self.renderer()?.render(Value::from(messages), true, extra)
    }

    /// The template compiled, to render many conversations (a syntax
    /// error: exit 2 naming the file and line).
    pub fn renderer(&self) -> anyhow::Result<Renderer<'_>> {
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .expect("the default delimiters");
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_template(COMPILED, &self.source)
            .map_err(|e| self.failure(e))?;
        if let Some(marked) = &self.marked {
            env.add_template(COMPILED_MARKED, marked)
                .map_err(|e| self.failure(e))?;
        }
        Ok(Renderer { env, of: self })
    }

    /// A template's error as exit 2 naming the file and line.
    fn failure(&self, e: Error) -> anyhow::Error {
        let at = e.line().map(|l| format!(" line {l}")).unwrap_or_default();
        let what = match e.kind() {
            ErrorKind::InvalidOperation if e.detail().is_some() => {
                format!("the template refuses: {}", e.detail().unwrap_or_default())
            }
            _ => e.to_string(),
        };
        Failure::bad_input(format!("{}:{at}: {what}", self.from.display()))
    }
}

/// A compiled [`ChatTemplate`].
pub struct Renderer<'a> {
    env: Environment<'a>,
    of: &'a ChatTemplate,
}

impl Renderer<'_> {
    /// The text of the conversation `messages` (a list of objects with a
    /// `role` and a `content`), as `apply_chat_template` renders it with
    /// `add_generation_prompt` and the keyword arguments `extra`.
    pub fn render(
        &self,
        messages: Value,
        add_generation_prompt: bool,
        extra: &[(String, Value)],
    ) -> anyhow::Result<String> {
        self.render_as(COMPILED, messages, add_generation_prompt, extra)
    }

    /// Where the template marks the assistant's text with `{% generation
    /// %}` blocks (as `transformers`' `return_assistant_tokens_mask`
    /// reads them): the whole conversation `messages` as [`Renderer::render`]
    /// lays it out (no generation prompt, the variables `extra`) and the
    /// byte ranges of its blocks. None for a template without such blocks.
    pub fn generation_spans(
        &self,
        messages: Value,
        extra: &[(String, Value)],
    ) -> Option<anyhow::Result<(String, Vec<std::ops::Range<usize>>)>> {
        self.of.marked.as_ref()?;
        let marked = match self.render_as(COMPILED_MARKED, messages, false, extra) {
            Ok(m) => m,
            Err(e) => return Some(Err(e)),
        };
        let mut text = String::with_capacity(marked.len());
        let (mut spans, mut open) = (Vec::new(), None);
        for c in marked.chars() {
            match c {
                c if c == MARKS[0] => open = open.or(Some(text.len())),
                c if c == MARKS[1] => spans.extend(open.take().map(|at| at..text.len())),
                c => text.push(c),
            }
        }
        spans.retain(|r: &std::ops::Range<usize>| !r.is_empty());
        Some(Ok((text, spans)))
    }

    /// [`Renderer::render`] with the compiled template `name`.
    fn render_as(
        &self,
        name: &str,
        messages: Value,
        add_generation_prompt: bool,
        extra: &[(String, Value)],
    ) -> anyhow::Result<String> {
        // The special tokens, which `extra` may override (as
        // `apply_chat_template`'s keyword arguments override them).
        let mut context: BTreeMap<String, Value> = self
            .of
            .specials
            .iter()
            .map(|(name, token)| (name.clone(), Value::from(token.as_str())))
            .collect();
        // No tools or documents unless `extra` gives them.
        context.insert("tools".into(), Value::from(()));
        context.insert("documents".into(), Value::from(()));
        context.extend(extra.iter().cloned());
        context.insert("messages".into(), with_reasoning_aliases(messages));
        context.insert(
            "add_generation_prompt".into(),
            Value::from(add_generation_prompt),
        );
        let template = self
            .env
            .get_template(name)
            .map_err(|e| self.of.failure(e))?;
        template
            .render(Value::from(context))
            .map_err(|e| self.of.failure(e))
    }
}

/// `source` with `transformers`' own block `{% generation %}…{%
/// endgeneration %}` (it marks the assistant's tokens for a training mask,
/// and renders its body as it is) made `{% if true %}…{% endif %}`: the
/// same output, whitespace control included, in plain Jinja. With `marks`,
/// the block's start and end also write [`MARKS`] where the tags stand:
/// the written character sits between an `if` that takes the tag's left
/// whitespace control (and `lstrip_blocks`) and an `endif` that takes its
/// right one (and `trim_blocks`), so that the text around is what it is
/// without them.
fn without_generation_tags(source: &str, marks: bool) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(open) = rest.find("{%") {
        let Some(close) = rest[open..].find("%}").map(|c| open + c + 2) else {
            break;
        };
        let tag = &rest[open..close];
        let inner = tag[2..tag.len() - 2].trim_matches(|c: char| c == '-' || c == '+');
        let keyword = match inner.trim() {
            "generation" => Some(("generation", "if true")),
            "endgeneration" => Some(("endgeneration", "endif")),
            _ => None,
        };
        out.push_str(&rest[..open]);
        match keyword {
            Some((name, _)) if marks => {
                let at = tag.find(name).expect("the keyword is in its tag");
                let (left, right) = (&tag[..at], &tag[at + name.len()..]);
                let mark = MARKS[usize::from(name == "endgeneration")];
                let write = format!("{{{{ '{mark}' }}}}");
                out.push_str(&match name {
                    "generation" => {
                        format!("{left}if true %}}{write}{{% if true %}}{{% endif{right}")
                    }
                    _ => format!("{left}if true %}}{{% endif %}}{write}{{% endif{right}"),
                });
            }
            Some((name, plain)) => out.push_str(&tag.replacen(name, plain, 1)),
            None => out.push_str(tag),
        }
        rest = &rest[close..];
    }
    out.push_str(rest);
    out
}

/// The JSON of `path`; exit 2 naming it where it is not.
fn read_json(path: &Path) -> anyhow::Result<serde_json::Value> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| Failure::bad_input(format!("{}: {e}", path.display())))?;
    serde_json::from_str(&text)
        .map_err(|e| Failure::bad_input(format!("{}: not JSON: {e}", path.display())))
}

/// The `chat_template` of a JSON object: a string, or a list of
/// `{name, template}` of which `default` is the one (as `transformers`
/// takes it); none where it has none.
fn template_in(json: &serde_json::Value, path: &Path) -> anyhow::Result<Option<String>> {
    let bad = |why: &str| Failure::bad_input(format!("{}: chat_template {why}", path.display()));
    match json.get("chat_template") {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
        Some(serde_json::Value::Array(list)) => {
            let named = |name: &str| {
                list.iter()
                    .find(|t| t.get("name").and_then(|n| n.as_str()) == Some(name))
            };
            let chosen = named("default")
                .ok_or_else(|| bad("is a list of named templates without one named `default`"))?;
            match chosen.get("template") {
                Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
                _ => Err(bad("`default` has no `template` string")),
            }
        }
        Some(other) => Err(bad(&format!(
            "is {other}: not a string or a list of named templates"
        ))),
    }
}

/// The special tokens of a `tokenizer_config.json`: each a string, or an
/// added token's object whose `content` is the string.
fn special_tokens(
    json: &serde_json::Value,
    path: &Path,
) -> anyhow::Result<BTreeMap<String, String>> {
    let mut out = BTreeMap::new();
    for name in SPECIAL_TOKENS {
        let token = match json.get(name) {
            None | Some(serde_json::Value::Null) => continue,
            Some(serde_json::Value::String(s)) => s.clone(),
            Some(v) => match v.get("content").and_then(|c| c.as_str()) {
                Some(s) => s.to_string(),
                None => {
                    return Err(Failure::bad_input(format!(
                    "{}: {name} is {v}: not a token (a string, or an object with its `content`)",
                    path.display()
                )))
                }
            },
        };
        out.insert(name.to_string(), token);
    }
    Ok(out)
}

/// A JSON value read as a template's value, objects keeping their keys'
/// order (a Python dict's, as `json.loads` gives it; serde_json's own
/// `Value` sorts them).
struct Json(Value);

impl<'de> serde::Deserialize<'de> for Json {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Json, D::Error> {
        d.deserialize_any(JsonVisitor)
    }
}

struct JsonVisitor;

impl<'de> serde::de::Visitor<'de> for JsonVisitor {
    type Value = Json;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_bool<E>(self, v: bool) -> Result<Json, E> {
        Ok(Json(Value::from(v)))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Json, E> {
        Ok(Json(Value::from(v)))
    }
    fn visit_u64<E>(self, v: u64) -> Result<Json, E> {
        Ok(Json(Value::from(v)))
    }
    fn visit_f64<E>(self, v: f64) -> Result<Json, E> {
        Ok(Json(Value::from(v)))
    }
    fn visit_str<E>(self, v: &str) -> Result<Json, E> {
        Ok(Json(Value::from(v)))
    }
    fn visit_unit<E>(self) -> Result<Json, E> {
        Ok(Json(Value::from(())))
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Json, A::Error> {
        let mut items = Vec::new();
        while let Some(Json(v)) = seq.next_element()? {
            items.push(v);
        }
        Ok(Json(Value::from(items)))
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Json, A::Error> {
        let mut pairs = indexmap::IndexMap::new();
        while let Some((k, Json(v))) = map.next_entry::<String, Json>()? {
            pairs.insert(Value::from(k), v);
        }
        Ok(Json(Value::from(pairs)))
    }
}

/// The names a message's reasoning goes by, the first given the one taken.
const REASONING_FIELDS: [&str; 3] = ["reasoning_content", "thinking", "reasoning"];

/// `messages` with each message's reasoning (under any of
/// [`REASONING_FIELDS`]) under `thinking` and `reasoning_content` too, as
/// `transformers` hands messages to a template: Qwen3's template reads
/// `reasoning_content`, gpt-oss's `thinking`, and datasets write any of the
/// three. As Python's `{"thinking": r, **message, "reasoning_content": r}`
/// orders the keys: `thinking` first (its own value, if it had one),
/// `reasoning_content` where the message had it, else last.
fn with_reasoning_aliases(messages: Value) -> Value {
    let Ok(list) = messages.try_iter() else {
        return messages;
    };
    if messages.kind() != ValueKind::Seq {
        return messages;
    }
    let aliased = |message: Value| {
        let reasoning = REASONING_FIELDS.iter().find_map(|name| {
            let v = message.get_attr(name).ok()?;
            (!v.is_undefined() && !v.is_none()).then_some(v)
        });
        let (Some(reasoning), ValueKind::Map) = (reasoning, message.kind()) else {
            return message;
        };
        let mut map = indexmap::IndexMap::new();
        map.insert(Value::from("thinking"), reasoning.clone());
        for key in message.try_iter().into_iter().flatten() {
            let value = message.get_item(&key).unwrap_or_default();
            map.insert(key, value);
        }
        map.insert(Value::from("reasoning_content"), reasoning);
        Value::from(map)
    };
    Value::from(list.map(aliased).collect::<Vec<_>>())
}

/// A `tools` value as `apply_chat_template(tools=...)` takes it: a list of
/// tools' JSON schemas (objects), or a JSON text of one (as TRL's datasets
/// often store it, and TRL reads it). None for none (absent, `null`).
pub fn tools_value(value: Value) -> anyhow::Result<Option<Value>> {
    let value = match value.as_str() {
        Some(text) => json_value(text)
            .map_err(|e| anyhow::anyhow!("`tools` is a string, and not JSON: {e}"))?,
        None => value,
    };
    if value.is_undefined() || value.is_none() {
        return Ok(None);
    }
    if value.kind() != ValueKind::Seq {
        anyhow::bail!(
            "`tools` must be a list of tools' JSON schemas (objects), or a JSON text of one"
        );
    }
    for (i, tool) in value.try_iter()?.enumerate() {
        if tool.kind() != ValueKind::Map {
            anyhow::bail!(
                "`tools` item {}: not an object (a tool's JSON schema: {{\"type\": \"function\", \"function\": {{...}}}})",
                i + 1
            );
        }
    }
    Ok(Some(value))
}

/// The template's arguments a record (a JSONL line, or a `--conversation`
/// file's object, read by [`json_value`]) carries beside its messages, as
/// TRL passes them to `apply_chat_template`: its `tools` (see
/// [`tools_value`]) and each variable of its `chat_template_kwargs`
/// (`{"enable_thinking": false}`).
pub fn record_args(record: &Value) -> anyhow::Result<Vec<(String, Value)>> {
    let mut args = Vec::new();
    if let Some(tools) = tools_value(record.get_attr("tools").unwrap_or_default())? {
        args.push(("tools".to_string(), tools));
    }
    let kwargs = record.get_attr("chat_template_kwargs").unwrap_or_default();
    if kwargs.is_undefined() || kwargs.is_none() {
        return Ok(args);
    }
    if kwargs.kind() != ValueKind::Map {
        anyhow::bail!("`chat_template_kwargs` must be an object of the template's variables");
    }
    for key in kwargs.try_iter()? {
        let name = key.as_str().unwrap_or_default();
        if RESERVED.contains(&name) {
            anyhow::bail!(
                "`chat_template_kwargs` sets `{name}`, which the record itself gives (`messages`, `tools`)"
            );
        }
        args.push((name.to_string(), kwargs.get_item(&key)?));
    }
    Ok(args)
}

/// A map of the pairs in their order (a Python dict's: what a template
/// iterating `.items()` or writing `tojson` sees).
fn map_of<'a>(pairs: impl IntoIterator<Item = (&'a str, Value)>) -> Value {
    let map: indexmap::IndexMap<Value, Value> = pairs
        .into_iter()
        .map(|(k, v)| (Value::from(k), v))
        .collect();
    Value::from(map)
}

/// `raise_exception(message)`: a template's own refusal (a role it does
/// not know, messages out of order).
fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// `strftime_now(format)`: the local time now, as Python's
/// `datetime.now().strftime` writes it (C's `strftime`, the C locale;
/// Llama 3.2's template dates its system prompt with it).
fn strftime_now(format: String) -> Result<String, Error> {
    let bad = |why: &str| Error::new(ErrorKind::InvalidOperation, format!("strftime_now: {why}"));
    let format = std::ffi::CString::new(format).map_err(|_| bad("a NUL in the format"))?;
    // SAFETY: `time` with a null pointer only returns the time.
    let now = unsafe { libc::time(std::ptr::null_mut()) };
    let mut tm = std::mem::MaybeUninit::<libc::tm>::uninit();
    // SAFETY: both pointers are valid for the call; `localtime_r` fills
    // `tm` when it returns non-null.
    if unsafe { libc::localtime_r(&now, tm.as_mut_ptr()) }.is_null() {
        return Err(bad("no local time"));
    }
    let mut buf = vec![0u8; 512];
    // SAFETY: `buf` holds `buf.len()` bytes, the format is NUL-terminated,
    // `tm` was filled above; `strftime` writes at most `buf.len()` bytes.
    let n = unsafe {
        libc::strftime(
            buf.as_mut_ptr().cast(),
            buf.len(),
            format.as_ptr(),
            tm.as_ptr(),
        )
    };
    buf.truncate(n);
    String::from_utf8(buf).map_err(|_| bad("not UTF-8"))
}

/// `value | tojson` (or `tojson(indent=N)`), as `transformers` overrides
/// Jinja's: Python's `json.dumps` with `ensure_ascii=False` (`", "` and
/// `": "` between items, keys in their order, nothing HTML-escaped).
fn tojson(value: Value, kwargs: Kwargs) -> Result<String, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    kwargs.assert_all_used()?;
    let mut out = String::new();
    write_json(&value, indent, 0, &mut out)?;
    Ok(out)
}

fn write_json(
    v: &Value,
    indent: Option<usize>,
    depth: usize,
    out: &mut String,
) -> Result<(), Error> {
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.extend(std::iter::repeat_n(' ', n * depth));
        }
    };
    let (item_sep, key_sep) = match indent {
        Some(_) => (",", ": "),
        None => (", ", ": "),
    };
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => match i64::try_from(v.clone()) {
            Ok(i) if v.is_integer() => out.push_str(&i.to_string()),
            _ => out.push_str(&python_float(f64::try_from(v.clone())?)),
        },
        ValueKind::String => {
            out.push_str(&serde_json::to_string(v.as_str().unwrap_or_default()).expect("a string"))
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                write_json(item, indent, depth + 1, out)?;
            }
            if !items.is_empty() {
                newline(out, depth);
            }
            out.push(']');
        }
        ValueKind::Map => {
            let keys: Vec<Value> = v.try_iter()?.collect();
            out.push('{');
            for (i, key) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                let name = key.as_str().map_or_else(|| key.to_string(), str::to_string);
                out.push_str(&serde_json::to_string(&name).expect("a string"));
                out.push_str(key_sep);
                write_json(&v.get_item(key)?, indent, depth + 1, out)?;
            }
            if !keys.is_empty() {
                newline(out, depth);
            }
            out.push('}');
        }
        _ => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: a {} is not JSON", v.kind()),
            ))
        }
    }
    Ok(())
}

/// A float as Python's `repr` writes it (what `json.dumps` writes): the
/// shortest digits that read back, in exponent form (`1e-05`, `1e+16`)
/// below 1e-4 and from 1e16, else positional with at least one decimal.
fn python_float(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').expect("{:e} has an exponent");
    let exp: i32 = exp.parse().expect("an integer exponent");
    if f != 0.0 && !(-4..16).contains(&exp) {
        let sign = if exp < 0 { '-' } else { '+' };
        return format!("{mantissa}e{sign}{:02}", exp.abs());
    }
    let plain = format!("{f}");
    if plain.contains('.') {
        plain
    } else {
        format!("{plain}.0")
    }
}

/// A JSON text as a template's value, objects keeping their keys' order.
pub fn json_value(text: &str) -> Result<Value, serde_json::Error> {
    serde_json::from_str::<Json>(text).map(|j| j.0)
}

/// The directory of a file such as `--tokenizer`'s (`.` for a bare name),
/// where its model's other files are looked for.
pub fn dir_of(file: &Path) -> &Path {
    match file.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    }
}

/// The variables the conversation itself sets.
const RESERVED: [&str; 4] = ["messages", "add_generation_prompt", "tools", "documents"];

/// A `--chat-arg KEY=VALUE`: the value as JSON (`false`, `3`, `"x"`,
/// `[...]`, objects keeping their keys' order), else as the string it is.
pub fn chat_arg(text: &str) -> anyhow::Result<(String, Value)> {
    let (key, value) = text.split_once('=').ok_or_else(|| {
        Failure::bad_input(format!(
            "--chat-arg {text}: give KEY=VALUE (enable_thinking=false)"
        ))
    })?;
    if key.is_empty() || !key.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
        return Err(Failure::bad_input(format!(
            "--chat-arg {text}: `{key}` is not a template variable's name"
        )));
    }
    if RESERVED.contains(&key) {
        return Err(Failure::bad_input(format!(
            "--chat-arg {text}: `{key}` comes with the conversation (its messages, its tools), not from --chat-arg"
        )));
    }
    let value = json_value(value).unwrap_or_else(|_| Value::from(value));
    Ok((key.to_string(), value))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A ChatML template (Qwen's layout) with a default system prompt.
    const CHATML: &str = "{%- if messages[0].role != 'system' %}\n<|im_start|>system\nYou are helpful.<|im_end|>\n{% endif %}\n{%- for m in messages %}\n<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}\n{%- if add_generation_prompt %}\n<|im_start|>assistant\n{% endif %}";

    fn render(source: &str, messages: &[(&str, &str)]) -> anyhow::Result<String> {
        let t = ChatTemplate {
            source: without_generation_tags(source, false),
            marked: None,
            from: "t.jinja".into(),
            specials: [("bos_token".to_string(), "<s>".to_string())].into(),
        };
        let ((role, prompt), earlier) = messages.split_last().expect("a message");
        assert_eq!(*role, "user", "the prompt is the user's");
        let earlier = earlier
            .iter()
            .map(|&(role, content)| {
                map_of([
                    ("role", Value::from(role)),
                    ("content", Value::from(content)),
                ])
            })
            .collect();
        t.render(None, earlier, prompt, &[])
    }

    /// The ChatML layout written out by hand: `trim_blocks` drops the
    /// newline after each tag, `{%-` the whitespace before.
    #[test]
    fn chatml_renders_as_written_by_hand() {
        assert_eq!(
            render(CHATML, &[("user", "Hi")]).unwrap(),
            "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
        assert_eq!(
            render(CHATML, &[("system", "Be brief."), ("user", "Hi")]).unwrap(),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
        assert_eq!(
            render(
                "{{ bos_token }}[{{ messages[0].content.strip() }}]",
                &[("user", " x ")]
            )
            .unwrap(),
            "<s>[x]"
        );
    }

    /// A template's own `raise_exception` and a syntax error are exit-2
    /// errors naming the file and the line.
    #[test]
    fn a_templates_refusal_names_its_file_and_line() {
        let e = render(
            "\n{% if messages|length > 1 %}{{ raise_exception('one message only') }}{% endif %}",
            &[("system", "a"), ("user", "b")],
        )
        .unwrap_err();
        let f = e.downcast_ref::<Failure>().expect("a Failure");
        assert_eq!(f.code, crate::exit::BAD_INPUT);
        assert!(
            f.message
                .starts_with("t.jinja: line 2: the template refuses: one message only"),
            "{}",
            f.message
        );
        let e = render("{% for m in messages %}", &[("user", "b")]).unwrap_err();
        assert!(e.to_string().contains("t.jinja: line 1"), "{e}");
    }

    /// `{% generation %}` renders its body as it is, whitespace control
    /// kept; the word elsewhere is left alone.
    #[test]
    fn generation_blocks_render_their_body() {
        assert_eq!(
            without_generation_tags(
                "a {%- generation -%} b {%+ endgeneration %}{{ 'generation' }}{% if x %}",
                false
            ),
            "a {%- if true -%} b {%+ endif %}{{ 'generation' }}{% if x %}"
        );
        assert_eq!(
            render(
                "<{% generation %}\n{{ messages[0].content }}{% endgeneration %}\n>",
                &[("user", "Hi")]
            )
            .unwrap(),
            "<Hi>"
        );
    }

    /// Marked, a template lays the conversation out as it does unmarked,
    /// whatever the whitespace control around its `{% generation %}` tags,
    /// and the marks fall where the tags stand.
    #[test]
    fn generation_blocks_mark_where_the_assistants_text_is() {
        let cases = [
            ("{% generation %}", "{% endgeneration %}", "Yo!\n"),
            ("  {%- generation %}", "  {% endgeneration -%}", "Yo!\n"),
            ("{%+ generation -%}\n", "{%- endgeneration +%}", "Yo!"),
        ];
        for (open, close, want) in cases {
            let source = format!(
                "{{% for m in messages %}}<{{{{ m.role }}}}>\n{{% if m.role == 'assistant' %}}\n{open}\n{{{{ m.content }}}}!\n{close}\n{{% else %}}{{{{ m.content }}}}\n{{% endif %}}{{% endfor %}}"
            );
            let plain = without_generation_tags(&source, false);
            let t = ChatTemplate {
                marked: Some(without_generation_tags(&source, true)),
                source: plain,
                from: "t.jinja".into(),
                specials: BTreeMap::new(),
            };
            let r = t.renderer().unwrap();
            let messages = || {
                json_value(
                    r#"[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"},
                    {"role": "user", "content": "Ok"}, {"role": "assistant", "content": "Yo"}]"#,
                )
                .unwrap()
            };
            let whole = r.render(messages(), false, &[]).unwrap();
            let (text, spans) = r.generation_spans(messages(), &[]).unwrap().unwrap();
            assert_eq!(text, whole, "{open} {close}");
            let marked: Vec<&str> = spans.iter().map(|s| &text[s.clone()]).collect();
            assert_eq!(marked, [want, want], "{open} {close}: {text:?}");
        }
    }

    #[test]
    fn tojson_writes_as_pythons_json_dumps() {
        let t = |json: &str, indent: Option<usize>| {
            let mut out = String::new();
            let (_, v) = chat_arg(&format!("v={json}")).unwrap();
            write_json(&v, indent, 0, &mut out).unwrap();
            out
        };
        assert_eq!(
            t(
                r#"{"z": [1, 2.5, "é\"\n"], "b": null, "c": true, "d": {}}"#,
                None
            ),
            "{\"z\": [1, 2.5, \"é\\\"\\n\"], \"b\": null, \"c\": true, \"d\": {}}"
        );
        assert_eq!(t(r#"{"a": [1]}"#, Some(2)), "{\n  \"a\": [\n    1\n  ]\n}");
        for (f, python) in [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (1e-5, "1e-05"),
            (1e16, "1e+16"),
            (123456.75, "123456.75"),
            (-2.5e-7, "-2.5e-07"),
            (0.0001, "0.0001"),
        ] {
            assert_eq!(python_float(f), python, "{f}");
        }
    }

    #[test]
    fn templates_are_found_as_transformers_finds_them() {
        let d = tempfile::tempdir().unwrap();
        let write = |name: &str, text: &str| std::fs::write(d.path().join(name), text).unwrap();
        let found = |file: Option<&Path>| {
            ChatTemplate::find(file, Some(d.path())).map(|t| t.expect("a template"))
        };
        assert!(ChatTemplate::find(None, Some(d.path())).unwrap().is_none());
        assert!(ChatTemplate::find(None, None).unwrap().is_none());
        write(
            TOKENIZER_CONFIG,
            r#"{"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}], "bos_token": {"content": "<s>", "lstrip": false}, "eos_token": "</s>", "pad_token": null}"#,
        );
        let t = found(None).unwrap();
        assert_eq!(
            (t.source.as_str(), t.path()),
            ("D", d.path().join(TOKENIZER_CONFIG).as_path())
        );
        assert_eq!(
            t.specials,
            [
                ("bos_token".to_string(), "<s>".to_string()),
                ("eos_token".to_string(), "</s>".to_string())
            ]
            .into()
        );
        write(TEMPLATE_JSON, r#"{"chat_template": "J"}"#);
        assert_eq!(found(None).unwrap().source, "J");
        write(TEMPLATE_FILE, "F");
        assert_eq!(found(None).unwrap().source, "F");
        let own = d.path().join("mine.jinja");
        std::fs::write(&own, "M").unwrap();
        let t = found(Some(&own)).unwrap();
        assert_eq!((t.source.as_str(), t.specials.len()), ("M", 2));
        // An explicit file wins over the directory's, which is not read.
        write(TOKENIZER_CONFIG, r#"{"chat_template": 3}"#);
        assert_eq!(found(Some(&own)).unwrap().source, "M");
        std::fs::remove_file(d.path().join(TEMPLATE_FILE)).unwrap();
        std::fs::remove_file(d.path().join(TEMPLATE_JSON)).unwrap();
        let e = found(None).unwrap_err();
        assert!(
            e.to_string().contains("chat_template is 3: not a string"),
            "{e}"
        );
        write(TOKENIZER_CONFIG, r#"{"bos_token": 3}"#);
        let e = found(None).unwrap_err();
        assert!(e.to_string().contains("bos_token is 3"), "{e}");
    }

    #[test]
    fn chat_args_are_json_or_strings() {
        assert_eq!(
            chat_arg("enable_thinking=false").unwrap(),
            ("enable_thinking".into(), Value::from(false))
        );
        assert_eq!(
            chat_arg("date_string=03 Dec 2026").unwrap(),
            ("date_string".into(), Value::from("03 Dec 2026"))
        );
        assert_eq!(chat_arg("x=").unwrap(), ("x".into(), Value::from("")));
        assert_eq!(chat_arg("n=[1, 2]").unwrap().1, Value::from(vec![1, 2]));
        for bad in ["novalue", "=3", "a-b=1", "messages=[]"] {
            let e = chat_arg(bad).unwrap_err();
            assert_eq!(
                e.downcast_ref::<Failure>().unwrap().code,
                crate::exit::BAD_INPUT,
                "{bad}"
            );
        }
    }

    /// Each message's reasoning reaches the template under all three names,
    /// keys ordered as transformers' `{"thinking": r, **message,
    /// "reasoning_content": r}` orders them; `reasoning_content` wins over
    /// `thinking` and `reasoning`, and a message without any is untouched.
    #[test]
    fn reasoning_is_given_under_each_name_in_pythons_order() {
        let messages = json_value(
            r#"[{"role": "assistant", "content": "a", "reasoning": "r"},
                {"role": "assistant", "reasoning_content": "c", "thinking": "t", "content": "b"},
                {"role": "assistant", "reasoning_content": null, "content": "d"}]"#,
        )
        .unwrap();
        let keyed = |m: &Value| -> Vec<(String, String)> {
            m.try_iter()
                .unwrap()
                .map(|k| (k.to_string(), m.get_item(&k).unwrap().to_string()))
                .collect()
        };
        let out: Vec<_> = with_reasoning_aliases(messages)
            .try_iter()
            .unwrap()
            .map(|m| keyed(&m))
            .collect();
        let pairs = |p: &[(&str, &str)]| -> Vec<(String, String)> {
            p.iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        assert_eq!(
            out[0],
            pairs(&[
                ("thinking", "r"),
                ("role", "assistant"),
                ("content", "a"),
                ("reasoning", "r"),
                ("reasoning_content", "r")
            ])
        );
        assert_eq!(
            out[1],
            pairs(&[
                ("thinking", "t"),
                ("role", "assistant"),
                ("reasoning_content", "c"),
                ("content", "b")
            ])
        );
        assert_eq!(
            out[2],
            pairs(&[
                ("role", "assistant"),
                ("reasoning_content", "None"),
                ("content", "d")
            ])
        );
    }

    /// `tools` as a list of objects or a JSON text of one (TRL's way);
    /// anything else is refused saying what a tool is; a record's
    /// `chat_template_kwargs` become variables, but not the record's own.
    #[test]
    fn tools_and_template_kwargs_come_from_a_record() {
        let listed = tools_value(json_value(r#"[{"type": "function"}]"#).unwrap()).unwrap();
        let texted = tools_value(Value::from(r#"[{"type": "function"}]"#)).unwrap();
        assert_eq!(listed, texted);
        assert_eq!(listed.unwrap().len(), Some(1));
        assert_eq!(tools_value(Value::from(())).unwrap(), None);
        assert_eq!(tools_value(Value::from("null")).unwrap(), None);
        for (bad, says) in [
            (r#"{"type": "function"}"#, "must be a list"),
            (r#"[{"type": "function"}, 3]"#, "item 2: not an object"),
            (r#""[{""#, "a string, and not JSON"),
        ] {
            let e = tools_value(json_value(bad).unwrap()).unwrap_err();
            assert!(e.to_string().contains(says), "{bad}: {e}");
        }
        let record = json_value(
            r#"{"messages": [], "tools": "[{}]", "chat_template_kwargs": {"enable_thinking": false, "x": [1]}}"#,
        )
        .unwrap();
        let args = record_args(&record).unwrap();
        let names: Vec<&str> = args.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["tools", "enable_thinking", "x"]);
        assert_eq!(args[1].1, Value::from(false));
        let plain = json_value(r#"{"messages": [], "chat_template_kwargs": null}"#).unwrap();
        assert!(record_args(&plain).unwrap().is_empty());
        for bad in [
            r#"{"chat_template_kwargs": {"messages": []}}"#,
            r#"{"chat_template_kwargs": [1]}"#,
        ] {
            assert!(record_args(&json_value(bad).unwrap()).is_err(), "{bad}");
        }
    }
}
