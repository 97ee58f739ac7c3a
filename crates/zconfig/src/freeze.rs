//! `train.freeze`: which parameters keep their values, as patterns over
//! zrun's parameter names (`wte.weight`, `h.3.attn.c_attn.weight`,
//! `layers.0.mlp.down_proj.weight`, `lm_head.weight`: [`crate::arch`]).
//!
//! A pattern matches a name whole. `*` matches any run of characters (none
//! included) and `{A-B}` a whole number from A to B written without leading
//! zeros, so `layers.{0-5}.*` is the first six blocks of a LLaMA and
//! `*norm*` every norm; anything else matches itself. One module for the
//! validator (every pattern must match a parameter of the model) and the
//! engine (which leaves frozen parameters out of the update, the gradient
//! norm and LAMB's trust ratios), so the two cannot disagree.

/// One piece of a pattern.
#[derive(Debug, Clone, PartialEq)]
enum Piece<'a> {
    Text(&'a str),
    Any,
    Number(u64, u64),
}

/// The pieces of `pattern`, or what is wrong with it.
fn parse(pattern: &str) -> Result<Vec<Piece<'_>>, String> {
    if pattern.is_empty() {
        return Err("an empty pattern matches no parameter".into());
    }
    let mut pieces = Vec::new();
    let mut rest = pattern;
    while !rest.is_empty() {
        let next = rest.find(['*', '{']).unwrap_or(rest.len());
        if next > 0 {
            pieces.push(Piece::Text(&rest[..next]));
            rest = &rest[next..];
            continue;
        }
        if let Some(after) = rest.strip_prefix('*') {
            pieces.push(Piece::Any);
            rest = after;
            continue;
        }
        let Some(close) = rest.find('}') else {
            return Err(format!("`{pattern}` opens a `{{` it does not close"));
        };
        let range = &rest[1..close];
        let bound = |s: &str| s.trim().parse::<u64>().ok();
        match range.split_once('-').map(|(a, b)| (bound(a), bound(b))) {
            Some((Some(lo), Some(hi))) if lo <= hi => pieces.push(Piece::Number(lo, hi)),
            _ => {
                return Err(format!(
                    "`{pattern}`: `{{{range}}}` is not a range of whole numbers such as {{0-5}}"
                ))
            }
        }
        rest = &rest[close + 1..];
    }
    Ok(pieces)
}

/// What is wrong with `pattern`'s syntax, if anything.
pub fn pattern_problem(pattern: &str) -> Option<String> {
    parse(pattern).err()
}

/// Whether `pattern` matches the whole of `name` (false for a pattern with
/// a syntax problem).
pub fn matches(pattern: &str, name: &str) -> bool {
    parse(pattern).is_ok_and(|p| match_pieces(&p, name))
}

/// Whether any of `patterns` matches `name`: the parameter is frozen.
pub fn frozen(patterns: &[String], name: &str) -> bool {
    patterns.iter().any(|p| matches(p, name))
}

/// What `train.freeze` freezes of the model `m`, for `zrun check` and the
/// start of `zrun train`: each pattern with the parameters it matches, and
/// the frozen elements' share. `None` without patterns.
pub fn summary(m: &crate::spec::ModelSpec, patterns: &[String]) -> Option<String> {
    if patterns.is_empty() {
        return None;
    }
    let params = m.param_shapes();
    let each: Vec<String> = patterns
        .iter()
        .map(|p| {
            let n = params.iter().filter(|(name, _)| matches(p, name)).count();
            format!("`{p}` {n}")
        })
        .collect();
    let numel = |shape: &Vec<usize>| shape.iter().product::<usize>();
    let total: usize = params.iter().map(|(_, s)| numel(s)).sum();
    let frozen: Vec<_> = params.iter().filter(|(n, _)| frozen(patterns, n)).collect();
    let held: usize = frozen.iter().map(|(_, s)| numel(s)).sum();
    Some(format!(
        "frozen (train.freeze: {}): {} of {} parameters, {} of {} elements ({:.1}%)",
        each.join(", "),
        frozen.len(),
        params.len(),
        held,
        total,
        100.0 * held as f64 / total.max(1) as f64
    ))
}

fn match_pieces(pieces: &[Piece<'_>], name: &str) -> bool {
    let Some((first, rest)) = pieces.split_first() else {
        return name.is_empty();
    };
    match *first {
        Piece::Text(t) => name
            .strip_prefix(t)
            .is_some_and(|after| match_pieces(rest, after)),
        Piece::Any => (0..=name.len())
            .filter(|&i| name.is_char_boundary(i))
            .any(|i| match_pieces(rest, &name[i..])),
        Piece::Number(lo, hi) => {
            let digits = name.bytes().take_while(u8::is_ascii_digit).count();
            // The whole run of digits is the number (so `{1-2}` does not
            // match the 1 of 12), without leading zeros.
            if digits == 0 || (digits > 1 && name.starts_with('0')) {
                return false;
            }
            name[..digits]
                .parse::<u64>()
                .is_ok_and(|n| (lo..=hi).contains(&n) && match_pieces(rest, &name[digits..]))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_match_whole_names() {
        let yes = [
            ("wte.weight", "wte.weight"),
            ("*", "h.0.ln_1.weight"),
            ("h.*", "h.11.mlp.c_fc.bias"),
            ("*norm*", "layers.3.input_layernorm.weight"),
            ("*norm*", "norm.weight"),
            ("layers.{0-5}.*", "layers.0.self_attn.qkv_proj.weight"),
            ("layers.{0-5}.*", "layers.5.mlp.down_proj.weight"),
            ("layers.{10-12}.*", "layers.11.mlp.down_proj.weight"),
            ("h.{0-0}.*.bias", "h.0.attn.c_proj.bias"),
            ("*.weight", ".weight"),
        ];
        for (p, n) in yes {
            assert!(matches(p, n), "{p} should match {n}");
        }
        let no = [
            ("wte.weight", "wte.weights"),
            ("wte", "wte.weight"),
            ("h.*", "wpe.weight"),
            ("layers.{0-5}.*", "layers.6.mlp.down_proj.weight"),
            ("layers.{1-2}.*", "layers.12.mlp.down_proj.weight"),
            ("layers.{0-5}.*", "layers.05.mlp.down_proj.weight"),
            ("layers.{0-5}.*", "layers..mlp"),
            ("*.bias", "h.0.attn.c_proj.weight"),
        ];
        for (p, n) in no {
            assert!(!matches(p, n), "{p} should not match {n}");
        }
        assert!(frozen(&["wpe.*".into(), "h.1.*".into()], "h.1.ln_2.bias"));
        assert!(!frozen(&[], "h.1.ln_2.bias"));
    }

    #[test]
    fn a_malformed_pattern_says_what_is_wrong() {
        for (p, said) in [
            ("", "empty"),
            ("layers.{0-5.*", "does not close"),
            ("layers.{5-0}.*", "not a range"),
            ("layers.{a-b}.*", "not a range"),
            ("layers.{3}.*", "not a range"),
        ] {
            let why = pattern_problem(p).unwrap_or_else(|| panic!("{p:?} was taken"));
            assert!(why.contains(said), "{p:?}: {why}");
            assert!(!matches(p, "layers.3.x"));
        }
        assert_eq!(pattern_problem("layers.{0-5}.*"), None);
    }
}
