//! Parquet rows as JSON text for `zrun prepare`, whose record path reads
//! JSON: keys in the file's column order (serde_json's own map sorts its
//! keys, and a chat template may iterate a message's), lists and structs
//! nested as arrays and objects.

use parquet::record::{Field, Row};

/// `row` as a JSON object, appended to `out`.
pub(crate) fn row(row: &Row, out: &mut String) {
    out.push('{');
    for (i, (name, field)) in row.get_column_iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        string(name, out);
        out.push(':');
        value(field, out);
    }
    out.push('}');
}

/// One value: groups, lists and maps walked in order, strings escaped,
/// the rest (numbers, booleans, null, dates, bytes) as the `parquet`
/// crate writes them as JSON.
fn value(field: &Field, out: &mut String) {
    match field {
        Field::Group(r) => row(r, out),
        Field::ListInternal(list) => {
            out.push('[');
            for (i, element) in list.elements().iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                value(element, out);
            }
            out.push(']');
        }
        Field::MapInternal(map) => {
            out.push('{');
            for (i, (key, v)) in map.entries().iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                match key {
                    Field::Str(k) => string(k, out),
                    other => string(&other.to_json_value().to_string(), out),
                }
                out.push(':');
                value(v, out);
            }
            out.push('}');
        }
        Field::Str(s) => string(s, out),
        other => out.push_str(&other.to_json_value().to_string()),
    }
}

/// `s` as a JSON string.
fn string(s: &str, out: &mut String) {
    out.push_str(&serde_json::to_string(s).expect("a string serialises"));
}
