//! Configuration errors. Every variant says where the problem is (a file and
//! position, a key path, a hostfile line, a command-line option) and what it is, so
//! that the launcher can print it as is and exit with code 2.

use std::path::PathBuf;

/// An error in user input: job spec, override, hostfile or launch option.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// A file could not be read.
    #[error("{path}: {cause}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause (shown in the message, so not also a `source`).
        cause: std::io::Error,
    },
    /// YAML that does not parse, or does not match the spec's shape.
    #[error("{path}:{line}:{column}: {message}")]
    Syntax {
        /// The spec file.
        path: PathBuf,
        /// 1-based line.
        line: u64,
        /// 1-based column.
        column: u64,
        /// What is wrong.
        message: String,
    },
    /// A value that parses but cannot be used.
    #[error("{location}: {key}: {message}")]
    Invalid {
        /// `file:line:col` where known, else the file (or `--set`).
        location: String,
        /// Dotted key path.
        key: String,
        /// What is wrong.
        message: String,
    },
    /// A `--set KEY=VALUE` override that is malformed or names no key.
    #[error("--set {assignment}: {message}")]
    Override {
        /// The override as given.
        assignment: String,
        /// What is wrong.
        message: String,
    },
    /// A hostfile line that cannot be used.
    #[error("{path}:{line}: {message}")]
    Hostfile {
        /// The hostfile.
        path: PathBuf,
        /// 1-based line.
        line: usize,
        /// What is wrong.
        message: String,
    },
    /// A launch option (`--include`, `--num-nodes` ...) that cannot be satisfied.
    #[error("{option}: {message}")]
    Option {
        /// The option, e.g. `--include`.
        option: String,
        /// What is wrong.
        message: String,
    },
}

/// Suggests the valid name closest to `given`, if one is close enough to be a typo.
pub fn did_you_mean<'a>(given: &str, valid: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    valid
        .into_iter()
        .map(|v| (strsim::damerau_levenshtein(given, v), v))
        .filter(|(d, v)| *d <= 2.max(v.len() / 3))
        .min_by_key(|(d, _)| *d)
        .map(|(_, v)| v)
}

/// Formats serde's "unknown field" error with a "did you mean" hint.
pub(crate) fn unknown_key_message(field: &str, expected: &[&str]) -> String {
    let mut msg = format!("unknown key `{field}`");
    if let Some(s) = did_you_mean(field, expected.iter().copied()) {
        msg.push_str(&format!(", did you mean `{s}`?"));
    } else if !expected.is_empty() {
        msg.push_str(&format!(" (valid keys: {})", expected.join(", ")));
    }
    msg
}

/// Says in the job's terms what serde-saphyr says in its own: a duplicate
/// key, or a `.nan`/`.inf` where a value is parsed on its own (`--set`),
/// come with advice about the library's options. Other messages pass
/// through.
pub(crate) fn plain_yaml_message(msg: &str) -> String {
    let msg = msg.split(" at line ").next().unwrap_or(msg);
    if let Some(rest) = msg.strip_prefix("duplicate mapping key: ") {
        let key = rest
            .split(", set DuplicateKeyPolicy")
            .next()
            .unwrap_or(rest);
        return format!("duplicate key `{key}` (each key may appear once in a mapping)");
    }
    if let Some(rest) = msg.strip_prefix("non-finite float ") {
        let value = rest.split(" rejected").next().unwrap_or(rest);
        return format!("expected a finite number, got {value}");
    }
    if let Some(rest) = msg.strip_prefix("budget breached: ") {
        // serde-saphyr's limits on what a document may expand to (aliases
        // of aliases: a "billion laughs" file).
        return format!(
            "the YAML grows past the parser's limits ({rest}), through aliases of aliases; a job spec needs none of that size"
        );
    }
    msg.to_string()
}

/// Rewrites serde_json's "unknown field `x`, expected one of `a`, `b`" into
/// [`unknown_key_message`]; other messages pass through.
pub(crate) fn improve_serde_message(msg: &str) -> String {
    let Some(rest) = msg.strip_prefix("unknown field `") else {
        return msg.to_string();
    };
    let Some((field, tail)) = rest.split_once('`') else {
        return msg.to_string();
    };
    let expected: Vec<&str> = tail
        .split('`')
        .enumerate()
        .filter(|(i, _)| i % 2 == 1)
        .map(|(_, s)| s)
        .collect();
    unknown_key_message(field, &expected)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn suggests_close_names_only() {
        assert_eq!(
            did_you_mean("stge", ["stage", "overlap_comm"]),
            Some("stage")
        );
        assert_eq!(did_you_mean("lr_rate", ["lr", "steps"]), None);
        assert_eq!(
            did_you_mean("micro_batch", ["micro_batch_size", "steps"]),
            Some("micro_batch_size")
        );
        assert_eq!(
            did_you_mean("micro_bach_size", ["micro_batch_size"]),
            Some("micro_batch_size")
        );
    }

    #[test]
    fn rewrites_serde_unknown_field() {
        let m =
            improve_serde_message("unknown field `stge`, expected one of `stage`, `overlap_comm`");
        assert_eq!(m, "unknown key `stge`, did you mean `stage`?");
        assert_eq!(improve_serde_message("invalid type"), "invalid type");
    }

    #[test]
    fn yaml_library_advice_becomes_the_jobs_terms() {
        assert_eq!(
            plain_yaml_message(
                "duplicate mapping key: model, set DuplicateKeyPolicy in Options if acceptable"
            ),
            "duplicate key `model` (each key may appear once in a mapping)"
        );
        assert_eq!(
            plain_yaml_message(
                "non-finite float `.nan` rejected by the configured policy at line 1, column 1"
            ),
            "expected a finite number, got `.nan`"
        );
        assert_eq!(plain_yaml_message("invalid u64"), "invalid u64");
    }
}
