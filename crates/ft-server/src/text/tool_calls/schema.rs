//! Parameter values of XML-style calls (`<parameter=n>\n5\n</parameter>`) are bare text; the tool's JSON
//! schema says what JSON value each one is. The rule, per parameter:
//!
//! - its schema's types, in order (`"type": "integer"`, `"type": ["integer", "null"]`, `anyOf`/`oneOf`
//!   members, else guessed from `enum`/`const`/`properties`/`items`); the first that the text parses as wins;
//! - `null`/`None` is JSON null where the schema allows null;
//! - text that fits none of the types, a parameter the schema does not name, or a tool without a schema
//!   stays a string (the model's text, never lost).

use serde_json::{Map, Value as Json};

/// What the schema says about one parameter.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct ParamType {
    /// JSON types in the schema's order, without `null`; empty: no type information (a string).
    pub types: Vec<&'static str>,
    pub nullable: bool,
}

impl ParamType {
    /// A plain string parameter: its text can be forwarded as it streams, nothing to convert.
    pub fn is_plain_string(&self) -> bool {
        !self.nullable && (self.types.is_empty() || self.types[0] == "string")
    }

    /// Reads the parameter's schema (`None`: the tool does not declare it).
    pub fn of(schema: Option<&Json>) -> ParamType {
        let mut t = ParamType::default();
        if let Some(s) = schema {
            collect(s, &mut t, 0);
        }
        t
    }
}

fn canonical(name: &str) -> Option<&'static str> {
    Some(match name.trim().to_ascii_lowercase().as_str() {
        "string" | "str" | "text" => "string",
        "integer" | "int" => "integer",
        "number" | "float" | "double" => "number",
        "boolean" | "bool" => "boolean",
        "object" | "dict" => "object",
        "array" | "list" => "array",
        "null" => "null",
        _ => return None,
    })
}

fn add(t: &mut ParamType, name: &'static str) {
    if name == "null" {
        t.nullable = true;
    } else if !t.types.contains(&name) {
        t.types.push(name);
    }
}

fn json_type_of(v: &Json) -> &'static str {
    match v {
        Json::Null => "null",
        Json::Bool(_) => "boolean",
        Json::Number(n) if n.is_i64() || n.is_u64() => "integer",
        Json::Number(_) => "number",
        Json::String(_) => "string",
        Json::Array(_) => "array",
        Json::Object(_) => "object",
    }
}

fn collect(schema: &Json, t: &mut ParamType, depth: usize) {
    let Json::Object(s) = schema else { return };
    if depth > 8 {
        return;
    }
    if s.get("nullable").and_then(Json::as_bool) == Some(true) {
        t.nullable = true;
    }
    match s.get("type") {
        Some(Json::String(name)) => {
            if let Some(c) = canonical(name) {
                add(t, c);
            }
            return;
        }
        Some(Json::Array(names)) => {
            for c in names.iter().filter_map(Json::as_str).filter_map(canonical) {
                add(t, c);
            }
            return;
        }
        _ => {}
    }
    let members = ["anyOf", "oneOf"].iter().filter_map(|k| s.get(*k)).filter_map(Json::as_array).flatten();
    let mut any = false;
    for m in members {
        any = true;
        collect(m, t, depth + 1);
    }
    if any {
        return;
    }
    if let Some(Json::Array(values)) = s.get("enum") {
        for v in values {
            add(t, json_type_of(v));
        }
    } else if let Some(v) = s.get("const") {
        add(t, json_type_of(v));
    } else if s.contains_key("properties") {
        add(t, "object");
    } else if s.contains_key("items") {
        add(t, "array");
    }
}

/// The JSON value of one parameter's text.
pub(crate) fn convert(text: &str, ty: &ParamType) -> Json {
    let trimmed = text.trim();
    if ty.nullable && (trimmed.eq_ignore_ascii_case("null") || trimmed == "None") {
        return Json::Null;
    }
    for t in &ty.types {
        if let Some(v) = convert_as(text, trimmed, t) {
            return v;
        }
    }
    Json::String(text.to_string())
}

fn convert_as(text: &str, trimmed: &str, ty: &str) -> Option<Json> {
    match ty {
        "string" => Some(Json::String(text.to_string())),
        "integer" => {
            if let Ok(i) = trimmed.parse::<i64>() {
                return Some(Json::from(i));
            }
            if let Ok(u) = trimmed.parse::<u64>() {
                return Some(Json::from(u));
            }
            // "5.0" is an integer written as a float.
            let f: f64 = trimmed.parse().ok()?;
            (f.is_finite() && f.fract() == 0.0 && f.abs() < 9.0e15).then(|| Json::from(f as i64))
        }
        "number" => match serde_json::from_str::<Json>(trimmed) {
            Ok(v @ Json::Number(_)) => Some(v),
            // Python/float spellings JSON lacks: "1.", ".5", "+2".
            _ => {
                let f: f64 = trimmed.parse().ok()?;
                let n = serde_json::Number::from_f64(f)?;
                Some(Json::Number(n))
            }
        },
        "boolean" => match trimmed.to_ascii_lowercase().as_str() {
            "true" => Some(Json::Bool(true)),
            "false" => Some(Json::Bool(false)),
            _ => None,
        },
        "object" | "array" => {
            let fits = |v: &Json| (ty == "object" && v.is_object()) || (ty == "array" && v.is_array());
            match serde_json::from_str::<Json>(trimmed) {
                Ok(v) if fits(&v) => Some(v),
                // Encoded twice ("{\"a\": 1}" as a JSON string).
                Ok(Json::String(inner)) => serde_json::from_str::<Json>(&inner).ok().filter(fits),
                _ => None,
            }
        }
        _ => None,
    }
}

/// The `properties` map of a tool's `parameters` schema, if it has one.
pub(crate) fn properties(parameters: &Json) -> Option<&Map<String, Json>> {
    parameters.get("properties").and_then(Json::as_object)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn conv(text: &str, schema: Json) -> Json {
        convert(text, &ParamType::of(Some(&schema)))
    }

    #[test]
    fn each_type() {
        assert_eq!(conv("Paris", json!({"type": "string"})), json!("Paris"));
        assert_eq!(conv("null", json!({"type": "string"})), json!("null"));
        assert_eq!(conv(" 42 ", json!({"type": "integer"})), json!(42));
        assert_eq!(conv("-7", json!({"type": "integer"})), json!(-7));
        assert_eq!(conv("18446744073709551615", json!({"type": "integer"})), json!(18446744073709551615u64));
        assert_eq!(conv("5.0", json!({"type": "integer"})), json!(5));
        assert_eq!(conv("5.5", json!({"type": "integer"})), json!("5.5"));
        assert_eq!(conv("2.5", json!({"type": "number"})), json!(2.5));
        assert_eq!(conv("3", json!({"type": "number"})), json!(3));
        assert_eq!(conv("1e3", json!({"type": "number"})), json!(1000.0));
        assert_eq!(conv(".5", json!({"type": "number"})), json!(0.5));
        assert_eq!(conv("nan", json!({"type": "number"})), json!("nan"));
        assert_eq!(conv("many", json!({"type": "number"})), json!("many"));
        assert_eq!(conv("True", json!({"type": "boolean"})), json!(true));
        assert_eq!(conv("false\n", json!({"type": "boolean"})), json!(false));
        assert_eq!(conv("yes", json!({"type": "boolean"})), json!("yes"));
        assert_eq!(conv("{\"a\": [1]}", json!({"type": "object"})), json!({"a": [1]}));
        assert_eq!(conv("[1, 2]", json!({"type": "array"})), json!([1, 2]));
        assert_eq!(conv("[1, 2]", json!({"type": "object"})), json!("[1, 2]"));
        assert_eq!(conv("\"{\\\"a\\\": 1}\"", json!({"type": "object"})), json!({"a": 1}));
        assert_eq!(conv("{'a': 1}", json!({"type": "object"})), json!("{'a': 1}"));
    }

    #[test]
    fn unions_nulls_and_guesses() {
        assert_eq!(conv("null", json!({"type": ["integer", "null"]})), json!(null));
        assert_eq!(conv("None", json!({"type": ["string", "null"]})), json!(null));
        assert_eq!(conv("7", json!({"type": ["integer", "null"]})), json!(7));
        assert_eq!(conv("7", json!({"anyOf": [{"type": "integer"}, {"type": "string"}]})), json!(7));
        assert_eq!(conv("seven", json!({"anyOf": [{"type": "integer"}, {"type": "string"}]})), json!("seven"));
        assert_eq!(conv("null", json!({"anyOf": [{"type": "string"}, {"type": "null"}]})), json!(null));
        assert_eq!(conv("null", json!({"type": "integer", "nullable": true})), json!(null));
        assert_eq!(conv("null", json!({"type": "integer"})), json!("null"));
        assert_eq!(conv("2", json!({"enum": [1, 2, 3]})), json!(2));
        assert_eq!(conv("c", json!({"enum": ["c", "f"]})), json!("c"));
        assert_eq!(conv("{\"x\": 1}", json!({"properties": {"x": {}}})), json!({"x": 1}));
        assert_eq!(conv("[]", json!({"items": {"type": "string"}})), json!([]));
        assert_eq!(conv("5", json!({"description": "no type"})), json!("5"));
        assert_eq!(conv("5", json!({"type": "weird"})), json!("5"));
        assert_eq!(convert("5", &ParamType::of(None)), json!("5"));
    }

    #[test]
    fn plain_strings_stream() {
        assert!(ParamType::of(None).is_plain_string());
        assert!(ParamType::of(Some(&json!({"type": "string"}))).is_plain_string());
        assert!(ParamType::of(Some(&json!({"description": "x"}))).is_plain_string());
        assert!(!ParamType::of(Some(&json!({"type": ["string", "null"]}))).is_plain_string());
        assert!(!ParamType::of(Some(&json!({"type": "integer"}))).is_plain_string());
        assert!(!ParamType::of(Some(&json!({"anyOf": [{"type": "integer"}, {"type": "string"}]}))).is_plain_string());
    }
}
