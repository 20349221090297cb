//! Order-preserving JSON. ComfyUI is Python: dicts keep insertion order, so the prompt a client
//! posted comes back from `/queue` and `/history` with its nodes and inputs in the original
//! order, and node ids in `progress_state` / `outputs` appear in execution order. The workspace's
//! `serde_json` is built without `preserve_order` (and turning that feature on here would change
//! the map order of every other crate in the workspace through feature unification), so this
//! module carries its own small ordered value type plus the few Python `str()`/`repr()`
//! renderings that ComfyUI leaks into its messages.

use std::fmt::Write as _;

use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::ser::{Serialize, SerializeMap, SerializeSeq, Serializer};

/// A JSON value whose objects keep their key order.
#[derive(Clone, Debug, PartialEq)]
pub enum OValue {
    Null,
    Bool(bool),
    Number(serde_json::Number),
    String(String),
    Array(Vec<OValue>),
    Object(OMap<OValue>),
}

/// An insertion-ordered string-keyed map; a `Vec` because the maps here are small.
#[derive(Clone, Debug, PartialEq)]
pub struct OMap<V>(pub Vec<(String, V)>);

impl<V> Default for OMap<V> {
    fn default() -> Self {
        OMap(Vec::new())
    }
}

impl<V> OMap<V> {
    pub fn new() -> Self {
        OMap(Vec::new())
    }
    pub fn get(&self, key: &str) -> Option<&V> {
        self.0.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }
    pub fn get_mut(&mut self, key: &str) -> Option<&mut V> {
        self.0.iter_mut().find(|(k, _)| k == key).map(|(_, v)| v)
    }
    pub fn contains_key(&self, key: &str) -> bool {
        self.get(key).is_some()
    }
    /// Python `d[k] = v`: an existing key keeps its position.
    pub fn insert(&mut self, key: impl Into<String>, value: V) {
        let key = key.into();
        match self.get_mut(&key) {
            Some(slot) => *slot = value,
            None => self.0.push((key, value)),
        }
    }
    pub fn remove(&mut self, key: &str) -> Option<V> {
        let at = self.0.iter().position(|(k, _)| k == key)?;
        Some(self.0.remove(at).1)
    }
    pub fn keys(&self) -> impl Iterator<Item = &String> {
        self.0.iter().map(|(k, _)| k)
    }
    pub fn iter(&self) -> impl Iterator<Item = (&String, &V)> {
        self.0.iter().map(|(k, v)| (k, v))
    }
    pub fn len(&self) -> usize {
        self.0.len()
    }
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl<V: Serialize> Serialize for OMap<V> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(Some(self.0.len()))?;
        for (k, v) in &self.0 {
            map.serialize_entry(k, v)?;
        }
        map.end()
    }
}

impl<'de, V: Deserialize<'de>> Deserialize<'de> for OMap<V> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct MapVisitor<V>(std::marker::PhantomData<V>);
        impl<'de, V: Deserialize<'de>> Visitor<'de> for MapVisitor<V> {
            type Value = OMap<V>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut access: A) -> Result<Self::Value, A::Error> {
                let mut map = OMap::new();
                while let Some((k, v)) = access.next_entry::<String, V>()? {
                    // json.loads keeps the last duplicate, at the first one's position.
                    map.insert(k, v);
                }
                Ok(map)
            }
        }
        deserializer.deserialize_map(MapVisitor(std::marker::PhantomData))
    }
}

impl Serialize for OValue {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            OValue::Null => serializer.serialize_unit(),
            OValue::Bool(b) => serializer.serialize_bool(*b),
            OValue::Number(n) => n.serialize(serializer),
            OValue::String(s) => serializer.serialize_str(s),
            OValue::Array(items) => {
                let mut seq = serializer.serialize_seq(Some(items.len()))?;
                for item in items {
                    seq.serialize_element(item)?;
                }
                seq.end()
            }
            OValue::Object(map) => map.serialize(serializer),
        }
    }
}

impl<'de> Deserialize<'de> for OValue {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct ValueVisitor;
        impl<'de> Visitor<'de> for ValueVisitor {
            type Value = OValue;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("any JSON value")
            }
            fn visit_bool<E>(self, v: bool) -> Result<OValue, E> {
                Ok(OValue::Bool(v))
            }
            fn visit_i64<E>(self, v: i64) -> Result<OValue, E> {
                Ok(OValue::Number(v.into()))
            }
            fn visit_u64<E>(self, v: u64) -> Result<OValue, E> {
                Ok(OValue::Number(v.into()))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<OValue, E> {
                serde_json::Number::from_f64(v)
                    .map(OValue::Number)
                    .ok_or_else(|| E::custom("non-finite number"))
            }
            fn visit_str<E>(self, v: &str) -> Result<OValue, E> {
                Ok(OValue::String(v.to_owned()))
            }
            fn visit_string<E>(self, v: String) -> Result<OValue, E> {
                Ok(OValue::String(v))
            }
            fn visit_unit<E>(self) -> Result<OValue, E> {
                Ok(OValue::Null)
            }
            fn visit_none<E>(self) -> Result<OValue, E> {
                Ok(OValue::Null)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut access: A) -> Result<OValue, A::Error> {
                let mut items = Vec::new();
                while let Some(item) = access.next_element()? {
                    items.push(item);
                }
                Ok(OValue::Array(items))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut access: A) -> Result<OValue, A::Error> {
                let mut map = OMap::new();
                while let Some((k, v)) = access.next_entry::<String, OValue>()? {
                    map.insert(k, v);
                }
                Ok(OValue::Object(map))
            }
        }
        deserializer.deserialize_any(ValueVisitor)
    }
}

/// A Python number: ComfyUI converts INT inputs with `int()` and FLOAT inputs with `float()`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum PyNum {
    Int(i128),
    Float(f64),
}

impl PyNum {
    pub fn as_f64(self) -> f64 {
        match self {
            PyNum::Int(i) => i as f64,
            PyNum::Float(f) => f,
        }
    }
    /// Python's mixed int/float ordering, exact when both are ints (seeds reach 2^64 - 1).
    pub fn lt(self, other: PyNum) -> bool {
        match (self, other) {
            (PyNum::Int(a), PyNum::Int(b)) => a < b,
            (a, b) => a.as_f64() < b.as_f64(),
        }
    }
    pub fn to_value(self) -> OValue {
        match self {
            PyNum::Int(i) => {
                if let Ok(v) = i64::try_from(i) {
                    OValue::Number(v.into())
                } else if let Ok(v) = u64::try_from(i) {
                    OValue::Number(v.into())
                } else {
                    OValue::Number(serde_json::Number::from_f64(i as f64).unwrap_or(0.into()))
                }
            }
            PyNum::Float(f) => OValue::Number(serde_json::Number::from_f64(f).unwrap_or(0.into())),
        }
    }
    pub fn from_number(n: &serde_json::Number) -> PyNum {
        if let Some(i) = n.as_i64() {
            PyNum::Int(i.into())
        } else if let Some(u) = n.as_u64() {
            PyNum::Int(u.into())
        } else {
            PyNum::Float(n.as_f64().unwrap_or(0.0))
        }
    }
}

impl std::fmt::Display for PyNum {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        match self {
            PyNum::Int(i) => write!(f, "{i}"),
            PyNum::Float(x) => f.write_str(&py_float(*x)),
        }
    }
}

/// Python's `repr(float)`: always shows a fraction or an exponent (`10.0`, `1e-07`).
pub fn py_float(x: f64) -> String {
    if x.is_nan() {
        return "nan".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "inf".into() } else { "-inf".into() };
    }
    let abs = x.abs();
    if abs != 0.0 && !(1e-4..1e16).contains(&abs) {
        // Rust prints `1e-7`; Python prints `1e-07`.
        let s = format!("{x:e}");
        if let Some((mantissa, exp)) = s.split_once('e') {
            let (sign, digits) = match exp.strip_prefix('-') {
                Some(d) => ("-", d),
                None => ("+", exp),
            };
            return format!("{mantissa}e{sign}{digits:0>2}");
        }
        return s;
    }
    let s = format!("{x}");
    if s.contains('.') { s } else { format!("{s}.0") }
}

impl OValue {
    pub fn str(s: impl Into<String>) -> OValue {
        OValue::String(s.into())
    }
    pub fn as_str(&self) -> Option<&str> {
        match self {
            OValue::String(s) => Some(s),
            _ => None,
        }
    }
    pub fn as_object(&self) -> Option<&OMap<OValue>> {
        match self {
            OValue::Object(m) => Some(m),
            _ => None,
        }
    }
    pub fn as_array(&self) -> Option<&Vec<OValue>> {
        match self {
            OValue::Array(a) => Some(a),
            _ => None,
        }
    }
    pub fn as_num(&self) -> Option<PyNum> {
        match self {
            OValue::Number(n) => Some(PyNum::from_number(n)),
            _ => None,
        }
    }
    pub fn get(&self, key: &str) -> Option<&OValue> {
        self.as_object().and_then(|m| m.get(key))
    }
    /// The Python type name, for ComfyUI's `TypeError` messages.
    pub fn py_type(&self) -> &'static str {
        match self {
            OValue::Null => "NoneType",
            OValue::Bool(_) => "bool",
            OValue::Number(n) => match PyNum::from_number(n) {
                PyNum::Int(_) => "int",
                PyNum::Float(_) => "float",
            },
            OValue::String(_) => "str",
            OValue::Array(_) => "list",
            OValue::Object(_) => "dict",
        }
    }
    /// Python truthiness (`bool(x)`).
    pub fn truthy(&self) -> bool {
        match self {
            OValue::Null => false,
            OValue::Bool(b) => *b,
            OValue::Number(n) => PyNum::from_number(n).as_f64() != 0.0,
            OValue::String(s) => !s.is_empty(),
            OValue::Array(a) => !a.is_empty(),
            OValue::Object(m) => !m.is_empty(),
        }
    }
    /// Python `str(x)` of the value `json.loads` would have produced.
    pub fn py_str(&self) -> String {
        match self {
            OValue::String(s) => s.clone(),
            other => other.py_repr(),
        }
    }
    /// Python `repr(x)`.
    pub fn py_repr(&self) -> String {
        let mut out = String::new();
        self.write_repr(&mut out);
        out
    }
    fn write_repr(&self, out: &mut String) {
        match self {
            OValue::Null => out.push_str("None"),
            OValue::Bool(true) => out.push_str("True"),
            OValue::Bool(false) => out.push_str("False"),
            OValue::Number(n) => {
                let _ = write!(out, "{}", PyNum::from_number(n));
            }
            OValue::String(s) => out.push_str(&py_str_repr(s)),
            OValue::Array(items) => {
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    item.write_repr(out);
                }
                out.push(']');
            }
            OValue::Object(map) => {
                out.push('{');
                for (i, (k, v)) in map.0.iter().enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    out.push_str(&py_str_repr(k));
                    out.push_str(": ");
                    v.write_repr(out);
                }
                out.push('}');
            }
        }
    }
}

/// Python `repr(str)`: single quotes unless the text holds a single quote and no double quote.
pub fn py_str_repr(s: &str) -> String {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    let mut out = String::with_capacity(s.len() + 2);
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push(quote);
    out
}

impl From<&str> for OValue {
    fn from(s: &str) -> OValue {
        OValue::String(s.to_owned())
    }
}
impl From<String> for OValue {
    fn from(s: String) -> OValue {
        OValue::String(s)
    }
}
impl From<bool> for OValue {
    fn from(b: bool) -> OValue {
        OValue::Bool(b)
    }
}
impl From<i64> for OValue {
    fn from(i: i64) -> OValue {
        OValue::Number(i.into())
    }
}
impl From<u64> for OValue {
    fn from(i: u64) -> OValue {
        OValue::Number(i.into())
    }
}
impl From<f64> for OValue {
    fn from(f: f64) -> OValue {
        PyNum::Float(f).to_value()
    }
}
impl<T: Into<OValue>> From<Vec<T>> for OValue {
    fn from(items: Vec<T>) -> OValue {
        OValue::Array(items.into_iter().map(Into::into).collect())
    }
}
impl From<OMap<OValue>> for OValue {
    fn from(m: OMap<OValue>) -> OValue {
        OValue::Object(m)
    }
}

/// Build an ordered object: `obj![("a", 1i64), ("b", "x")]`.
#[macro_export]
macro_rules! obj {
    ($(($k:expr, $v:expr)),* $(,)?) => {{
        #[allow(unused_mut)]
        let mut m = $crate::ojson::OMap::<$crate::ojson::OValue>::new();
        $( m.insert($k, $crate::ojson::OValue::from($v)); )*
        $crate::ojson::OValue::Object(m)
    }};
}

/// Serialise to a compact JSON string. Serialising these types cannot fail (string keys only).
pub fn to_string<T: Serialize>(value: &T) -> String {
    serde_json::to_string(value).unwrap_or_else(|_| "null".to_owned())
}

/// Python's `json.dumps(value)` with its defaults, as ComfyUI's SaveImage writes the prompt into
/// a PNG: `", "` and `": "` separators, and `ensure_ascii`: every character outside printable
/// ASCII as `\uXXXX` (astral ones as a surrogate pair), so the text is plain ASCII and fits PNG
/// `tEXt`, which is Latin-1 only.
pub fn py_json_dumps(value: &OValue) -> String {
    let mut out = String::new();
    write_py_json(value, &mut out);
    out
}

fn write_py_json(value: &OValue, out: &mut String) {
    match value {
        OValue::Null => out.push_str("null"),
        OValue::Bool(true) => out.push_str("true"),
        OValue::Bool(false) => out.push_str("false"),
        OValue::Number(n) => out.push_str(&PyNum::from_number(n).to_string()),
        OValue::String(s) => write_py_json_str(s, out),
        OValue::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_py_json(item, out);
            }
            out.push(']');
        }
        OValue::Object(map) => {
            out.push('{');
            for (i, (key, item)) in map.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_py_json_str(key, out);
                out.push_str(": ");
                write_py_json(item, out);
            }
            out.push('}');
        }
    }
}

/// `json.encoder.py_encode_basestring_ascii`: `"` and `\\` escaped, the five short control
/// escapes, everything else outside `' '..='~'` as `\u` + four lowercase hex digits.
fn write_py_json_str(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            ' '..='~' => out.push(c),
            c => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_key_order_and_python_renderings() {
        let v: OValue = serde_json::from_str(r#"{"b":1,"a":[2.0,"x'y"],"c":null}"#).expect("json");
        assert_eq!(to_string(&v), r#"{"b":1,"a":[2.0,"x'y"],"c":null}"#);
        assert_eq!(v.py_repr(), r#"{'b': 1, 'a': [2.0, "x'y"], 'c': None}"#);
        assert_eq!(py_float(1e-7), "1e-07");
        assert_eq!(py_float(10.0), "10.0");
        assert_eq!(py_float(0.5), "0.5");
    }

    #[test]
    fn dumps_like_python_json_with_ensure_ascii() {
        let v: OValue = serde_json::from_str(
            r#"{"6": {"class_type": "CLIPTextEncode", "inputs": {"text": "一只红狐狸 🦊 雪の中 \"q\" \\ \n\t\u0001\u007f é", "clip": ["4", 1]}}, "3": {"inputs": {"seed": 18446744073709551615, "cfg": 7.0, "denoise": 1, "x": 1e-7, "y": 1e16, "z": 0.1, "b": true, "n": null}}}"#,
        )
        .expect("json");
        // Bytes as Python 3.11's `json.dumps` printed them for the same object.
        let python = r#"{"6": {"class_type": "CLIPTextEncode", "inputs": {"text": "\u4e00\u53ea\u7ea2\u72d0\u72f8 \ud83e\udd8a \u96ea\u306e\u4e2d \"q\" \\ \n\t\u0001\u007f \u00e9", "clip": ["4", 1]}}, "3": {"inputs": {"seed": 18446744073709551615, "cfg": 7.0, "denoise": 1, "x": 1e-07, "y": 1e+16, "z": 0.1, "b": true, "n": null}}}"#;
        assert_eq!(py_json_dumps(&v), python);
        assert!(py_json_dumps(&v).is_ascii());
    }
}
