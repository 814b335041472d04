//! Exact byte counts that may be fractional, as Accelerate's Python arithmetic produces them.

use std::cmp::Ordering;
use std::fmt;
use std::ops::{Add, AddAssign, Sub};

/// A size in bytes, kept exactly as a whole number of bits.
///
/// Accelerate sizes a `bool` element as `1/8` byte, so sizes are Python `int`s
/// or, once a fractional element size is involved, Python `float`s. Both the
/// value and that int/float distinction are observable (messages print `12.0`
/// for a float, and floor division keeps the type), so `Bytes` tracks both.
/// Every fractional size Accelerate can produce is a multiple of 1/8 byte, so a
/// bit count is exact where Python's float is exact. Comparison and equality look
/// at the value only, as `1 == 1.0` in Python.
#[derive(Clone, Copy, Default)]
pub struct Bytes {
    bits: i128,
    float: bool,
}

impl Bytes {
    /// Zero as a Python `int` (the start value of Accelerate's counters).
    pub const ZERO: Bytes = Bytes {
        bits: 0,
        float: false,
    };

    /// A whole number of bytes held as a Python `int`.
    pub const fn new(bytes: i64) -> Self {
        Bytes {
            bits: bytes as i128 * 8,
            float: false,
        }
    }

    /// A size from a bit count, held as a Python `float` when `float` is true.
    ///
    /// An `int` must be a whole number of bytes; a bit count that is not is held as a float.
    pub const fn from_bits(bits: i128, float: bool) -> Self {
        Bytes {
            bits,
            float: float || bits % 8 != 0,
        }
    }

    /// A Python `float` number of bytes, rounded down to a whole bit.
    ///
    /// Every size Accelerate computes is a multiple of 1/8 byte; only a float
    /// written by hand (such as `max_memory={0: 1.3e9 * 0.9}`) can need rounding.
    pub fn from_f64(bytes: f64) -> Self {
        Bytes {
            bits: (bytes * 8.0).floor() as i128,
            float: true,
        }
    }

    /// The size in bits.
    pub const fn bits(self) -> i128 {
        self.bits
    }

    /// Whether Python would hold this value as a `float`.
    pub const fn is_float(self) -> bool {
        self.float
    }

    /// The size in bytes as an `f64` (exact below 2^50 bytes).
    pub fn as_f64(self) -> f64 {
        self.bits as f64 / 8.0
    }

    /// The size in whole bytes when it is integral.
    pub fn as_integral(self) -> Option<i128> {
        (self.bits % 8 == 0).then_some(self.bits / 8)
    }

    /// `self * n`, as Python multiplies an `int` or `float` by an `int`.
    pub fn times(self, n: u128) -> Self {
        Bytes {
            bits: self.bits * n as i128,
            float: self.float,
        }
    }

    /// Python's `self // n` for a positive integer `n`: rounds towards negative
    /// infinity and keeps the int/float type.
    pub fn floor_div(self, n: u64) -> Self {
        let bytes = self.bits.div_euclid(8 * n as i128);
        Bytes {
            bits: bytes * 8,
            float: self.float,
        }
    }

    /// Python's `int(x)`: truncates towards zero and gives an `int`.
    pub fn to_int(self) -> Self {
        Bytes {
            bits: (self.bits / 8) * 8,
            float: false,
        }
    }

    /// Python's `min(self, other)`: `other` only when strictly smaller, so on a
    /// tie the first argument (and its int/float type) wins.
    pub fn py_min(self, other: Bytes) -> Bytes {
        if other < self {
            other
        } else {
            self
        }
    }

    /// Python's `max(self, other)`: `other` only when strictly larger.
    pub fn py_max(self, other: Bytes) -> Bytes {
        if other > self {
            other
        } else {
            self
        }
    }
}

impl PartialEq for Bytes {
    fn eq(&self, other: &Self) -> bool {
        self.bits == other.bits
    }
}

impl Eq for Bytes {}

impl PartialOrd for Bytes {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Bytes {
    fn cmp(&self, other: &Self) -> Ordering {
        self.bits.cmp(&other.bits)
    }
}

impl std::hash::Hash for Bytes {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.bits.hash(state)
    }
}

impl Add for Bytes {
    type Output = Bytes;
    fn add(self, rhs: Bytes) -> Bytes {
        Bytes {
            bits: self.bits + rhs.bits,
            float: self.float || rhs.float,
        }
    }
}

impl AddAssign for Bytes {
    fn add_assign(&mut self, rhs: Bytes) {
        *self = *self + rhs;
    }
}

impl Sub for Bytes {
    type Output = Bytes;
    fn sub(self, rhs: Bytes) -> Bytes {
        Bytes {
            bits: self.bits - rhs.bits,
            float: self.float || rhs.float,
        }
    }
}

impl std::iter::Sum for Bytes {
    fn sum<I: Iterator<Item = Bytes>>(iter: I) -> Bytes {
        iter.fold(Bytes::ZERO, Add::add)
    }
}

impl From<i64> for Bytes {
    fn from(bytes: i64) -> Self {
        Bytes::new(bytes)
    }
}

impl From<u64> for Bytes {
    fn from(bytes: u64) -> Self {
        Bytes {
            bits: bytes as i128 * 8,
            float: false,
        }
    }
}

/// Prints the value as Python's `str()` would: `12` for an int, `12.0` or `12.125` for a float.
impl fmt::Display for Bytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if !self.float {
            return write!(f, "{}", self.bits / 8);
        }
        let value = self.as_f64();
        if value.abs() >= 1e16 {
            // Python switches repr to exponent form from 1e16 on, and always signs the exponent.
            let s = format!("{value:e}");
            let (mantissa, exp) = s.split_once('e').unwrap_or((&s, "0"));
            match exp.strip_prefix('-') {
                Some(e) => write!(f, "{mantissa}e-{e:0>2}"),
                None => write!(f, "{mantissa}e+{exp:0>2}"),
            }
        } else if value.fract() == 0.0 {
            write!(f, "{}.0", self.bits / 8)
        } else {
            // Rust's shortest round-trip form equals Python's repr in this range.
            write!(f, "{value}")
        }
    }
}

impl fmt::Debug for Bytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// Serialises as a JSON integer when the value is integral, as a float otherwise
/// (the convention of the reference cases: integral floats are written as ints).
impl serde::Serialize for Bytes {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self.as_integral().and_then(|b| i64::try_from(b).ok()) {
            Some(b) => serializer.serialize_i64(b),
            None => serializer.serialize_f64(self.as_f64()),
        }
    }
}

impl<'de> serde::Deserialize<'de> for Bytes {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let value = serde_json::Number::deserialize(deserializer)?;
        if let Some(i) = value.as_i64() {
            Ok(Bytes::new(i))
        } else if let Some(u) = value.as_u64() {
            Ok(Bytes::from(u))
        } else {
            Ok(Bytes::from_f64(value.as_f64().unwrap_or(f64::NAN)))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ints_and_floats_print_like_python() {
        assert_eq!(Bytes::new(12).to_string(), "12");
        assert_eq!(Bytes::from_bits(96, true).to_string(), "12.0");
        assert_eq!(Bytes::from_bits(97, false).to_string(), "12.125");
        assert_eq!(Bytes::from_bits(-4, true).to_string(), "-0.5");
        assert_eq!(
            Bytes::from_bits(8 * 10_i128.pow(16), true).to_string(),
            "1e+16"
        );
        assert_eq!(
            Bytes::from_bits(8 * 12 * 10_i128.pow(16), true).to_string(),
            "1.2e+17"
        );
    }

    #[test]
    fn floor_division_keeps_the_type_and_floors() {
        let float = Bytes::from_bits(8 * 7 + 4, true); // 7.5
        assert_eq!(float.floor_div(2).to_string(), "3.0");
        assert_eq!(Bytes::new(7).floor_div(2).to_string(), "3");
        assert_eq!(Bytes::new(-7).floor_div(2).to_string(), "-4");
    }

    #[test]
    fn min_and_max_keep_the_first_argument_on_ties() {
        let int = Bytes::new(4);
        let float = Bytes::from_bits(32, true);
        assert!(!int.py_min(float).is_float());
        assert!(float.py_min(int).is_float());
        assert!(!int.py_max(float).is_float());
        assert_eq!(int, float);
    }

    #[test]
    fn adding_a_float_makes_a_float() {
        let sum = Bytes::new(3) + Bytes::from_bits(1, true);
        assert!(sum.is_float());
        assert_eq!(sum.to_string(), "3.125");
        assert_eq!((Bytes::new(3) + Bytes::new(1)).to_string(), "4");
    }
}
