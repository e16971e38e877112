//! Strict JSON formats: every object of a config or stats file may hold only the fields its
//! section knows. serde's `deny_unknown_fields` would reject a typo too, but could not say in
//! which table it sits or what was meant; a misspelled limit that were ignored instead would
//! silently become the default 256.

use serde_json::Value;

use crate::error::{Error, Result};

/// The fields one kind of JSON object may hold.
#[derive(Debug)]
pub(crate) struct Section {
    /// How messages name an object of this kind: a kind ("table") for array items and map
    /// values, the document ("the config") for the root; nested objects go by their key.
    pub what: &'static str,
    /// The field whose value names one object of this kind in messages (`name`), if any.
    pub named_by: Option<&'static str>,
    /// Every field, with what its value holds.
    pub fields: &'static [(&'static str, Nested)],
}

/// What a field's value holds, as far as field checking goes.
#[derive(Debug)]
pub(crate) enum Nested {
    /// A scalar, an array of scalars, or an object whose keys are data (names of stacks).
    Leaf,
    /// An object of the given kind.
    Object(&'static Section),
    /// An array of objects of the given kind.
    ArrayOf(&'static Section),
    /// An object whose keys are data and whose values are objects of the given kind.
    MapOf(&'static Section),
}

/// Checks a whole document (an object of kind `section`) and everything below it.
pub(crate) fn check(value: &Value, section: &'static Section) -> Result<()> {
    check_at(value, section, None)
}

/// Checks `value` (an object of kind `section`), which `location` names (`None`: the document).
fn check_at(value: &Value, section: &'static Section, location: Option<&str>) -> Result<()> {
    let Value::Object(map) = value else {
        return Ok(());
    }; // wrong types are serde's to report
    let here = location.unwrap_or(section.what);
    for (key, field) in map {
        let Some((_, nested)) = section.fields.iter().find(|(name, _)| name == key) else {
            return Err(Error::UnknownField {
                field: key.clone(),
                location: here.to_string(),
                suggestion: closest(key, section.fields.iter().map(|(name, _)| *name)),
            });
        };
        match nested {
            Nested::Leaf => {}
            Nested::Object(inner) => {
                let place = match location {
                    None => format!("`{key}`"),
                    Some(outer) => format!("`{key}` of {outer}"),
                };
                check_at(field, inner, Some(&place))?
            }
            Nested::ArrayOf(inner) => {
                for (i, item) in field.as_array().into_iter().flatten().enumerate() {
                    check_at(
                        item,
                        inner,
                        Some(&name_of(item, inner, &format!("{key}[{i}]"))),
                    )?;
                }
            }
            Nested::MapOf(inner) => {
                for (name, item) in field.as_object().into_iter().flatten() {
                    check_at(item, inner, Some(&format!("{} `{name}`", inner.what)))?;
                }
            }
        }
    }
    Ok(())
}

/// "table `t03`" when the object carries its name, else its position ("tables[3]").
fn name_of(item: &Value, section: &Section, position: &str) -> String {
    match section
        .named_by
        .and_then(|k| item.get(k))
        .and_then(Value::as_str)
    {
        Some(name) => format!("{} `{name}`", section.what),
        None => position.to_string(),
    }
}

/// The known field closest to `key`, when it is close enough to be what was meant: within a
/// third of its length in edits (so `max_ids_per_partitions` finds `max_ids_per_partition`,
/// and `foo` finds nothing).
fn closest<'a>(key: &str, known: impl Iterator<Item = &'a str>) -> Option<String> {
    known
        .map(|k| (strsim::damerau_levenshtein(key, k), k))
        .filter(|&(d, k)| d <= (k.chars().count().max(key.chars().count()) / 3).max(1))
        .min_by_key(|&(d, _)| d)
        .map(|(_, k)| k.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    static INNER: Section = Section {
        what: "table",
        named_by: Some("name"),
        fields: &[
            ("name", Nested::Leaf),
            ("max_ids_per_partition", Nested::Leaf),
        ],
    };
    static TOP: Section = Section {
        what: "the config",
        named_by: None,
        fields: &[
            ("tables", Nested::ArrayOf(&INNER)),
            ("limits", Nested::MapOf(&INNER)),
        ],
    };

    #[test]
    fn unknown_fields_are_named_with_where_they_are_and_what_was_meant() {
        let v: Value = serde_json::from_str(
            r#"{"tables": [{"name": "t0"}, {"name": "t03", "max_ids_per_partitions": 4}]}"#,
        )
        .unwrap();
        let e = check(&v, &TOP).unwrap_err();
        assert_eq!(e.to_string(), "unknown field `max_ids_per_partitions` in table `t03`; did you mean `max_ids_per_partition`?");
        let v: Value = serde_json::from_str(r#"{"tables": [{"nmae": "x"}]}"#).unwrap();
        assert_eq!(
            check(&v, &TOP).unwrap_err().to_string(),
            "unknown field `nmae` in tables[0]; did you mean `name`?"
        );
        let v: Value = serde_json::from_str(r#"{"limits": {"s0": {"frobnicate": 1}}}"#).unwrap();
        assert_eq!(
            check(&v, &TOP).unwrap_err().to_string(),
            "unknown field `frobnicate` in table `s0`"
        );
        let v: Value = serde_json::from_str(r#"{"tabels": []}"#).unwrap();
        assert_eq!(
            check(&v, &TOP).unwrap_err().to_string(),
            "unknown field `tabels` in the config; did you mean `tables`?"
        );
        assert!(check(
            &serde_json::from_str(r#"{"tables": [{"name": "t0", "max_ids_per_partition": 1}]}"#)
                .unwrap(),
            &TOP
        )
        .is_ok());
    }
}
