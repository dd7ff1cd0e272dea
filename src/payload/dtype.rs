//! The integer dtypes a payload may carry, their numpy names, ranges and promotion.

use crate::error::{Error, Result};

/// An integer element type, named as numpy names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// `uint8`: models with up to 256 experts.
    U8,
    /// `int8`.
    I8,
    /// `uint16`: models with up to 65536 experts (Kimi K2's 384).
    U16,
    /// `int16`: a `-1` sentinel with up to 32768 experts.
    I16,
    /// `uint32`.
    U32,
    /// `int32`: SGLang's default, and the trainer's.
    I32,
    /// `int64`.
    I64,
}

impl DType {
    /// Every dtype, smallest first within each signedness.
    pub const ALL: [DType; 7] = [
        DType::U8,
        DType::I8,
        DType::U16,
        DType::I16,
        DType::U32,
        DType::I32,
        DType::I64,
    ];

    /// The numpy dtype name, as written in the sidecar's `dtype` field.
    pub fn name(self) -> &'static str {
        match self {
            DType::U8 => "uint8",
            DType::I8 => "int8",
            DType::U16 => "uint16",
            DType::I16 => "int16",
            DType::U32 => "uint32",
            DType::I32 => "int32",
            DType::I64 => "int64",
        }
    }

    /// The dtype of a numpy name (`"uint8"`); an unknown name is a `PayloadError`.
    pub fn parse(name: &str) -> Result<DType> {
        DType::ALL
            .into_iter()
            .find(|d| d.name() == name)
            .ok_or_else(|| {
                Error::field(
                    "dtype",
                    "one of uint8, int8, uint16, int16, uint32, int32, int64",
                    format!("{name:?}"),
                )
            })
    }

    /// Bytes per value.
    pub fn itemsize(self) -> usize {
        match self {
            DType::U8 | DType::I8 => 1,
            DType::U16 | DType::I16 => 2,
            DType::U32 | DType::I32 => 4,
            DType::I64 => 8,
        }
    }

    /// The smallest value it holds.
    pub fn min(self) -> i64 {
        match self {
            DType::U8 | DType::U16 | DType::U32 => 0,
            DType::I8 => i8::MIN.into(),
            DType::I16 => i16::MIN.into(),
            DType::I32 => i32::MIN.into(),
            DType::I64 => i64::MIN,
        }
    }

    /// The largest value it holds.
    pub fn max(self) -> i64 {
        match self {
            DType::U8 => u8::MAX.into(),
            DType::I8 => i8::MAX.into(),
            DType::U16 => u16::MAX.into(),
            DType::I16 => i16::MAX.into(),
            DType::U32 => u32::MAX.into(),
            DType::I32 => i32::MAX.into(),
            DType::I64 => i64::MAX,
        }
    }

    /// Whether `value` fits.
    pub fn holds(self, value: i64) -> bool {
        self.min() <= value && value <= self.max()
    }

    /// The smallest dtype whose range covers both: uint8 + uint16 -> uint16, uint8 + int8 -> int16.
    /// Never a dtype that would truncate either side.
    pub fn promote(a: DType, b: DType) -> DType {
        let (lo, hi) = (a.min().min(b.min()), a.max().max(b.max()));
        DType::ALL
            .into_iter()
            .filter(|d| d.min() <= lo && hi <= d.max())
            .min_by_key(|d| (d.itemsize(), d.min() != 0))
            .unwrap_or(DType::I64)
    }

    /// format.md §3.1 compact choice by the values: uint8, uint16, then int16/int32 for negatives.
    pub fn compact_for_range(min: i64, max: i64) -> Result<DType> {
        let candidates: &[DType] = if min >= 0 {
            &[DType::U8, DType::U16, DType::I32]
        } else {
            &[DType::I16, DType::I32]
        };
        candidates
            .iter()
            .copied()
            .find(|d| d.holds(min) && d.holds(max))
            .ok_or_else(|| {
                Error::field(
                    "array",
                    "values that fit int32 (pass an explicit dtype for wider ids)",
                    format!("values in [{min}, {max}]"),
                )
            })
    }

    /// The dtype every payload of a model with `num_experts` experts gets: uint8 up to 256
    /// experts, uint16 up to 65536, int32 beyond.
    pub fn for_num_experts(num_experts: u64) -> Result<DType> {
        match num_experts {
            0 => Err(Error::field("num_experts", "a positive integer", 0)),
            1..=256 => Ok(DType::U8),
            257..=65536 => Ok(DType::U16),
            n if n <= i32::MAX as u64 + 1 => Ok(DType::I32),
            n => Err(Error::field("num_experts", "at most 2**31", n)),
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// An element type a payload can be viewed as.
pub trait Element:
    bytemuck::Pod + Copy + Ord + Into<i64> + TryFrom<i64> + Send + Sync + 'static
{
    /// The dtype of this element type.
    const DTYPE: DType;
}

macro_rules! element {
    ($($t:ty => $d:ident),*) => { $(impl Element for $t { const DTYPE: DType = DType::$d; })* };
}
element!(u8 => U8, i8 => I8, u16 => U16, i16 => I16, u32 => U32, i32 => I32, i64 => I64);

/// Run `$body` with `$t` bound to the Rust element type of `$dtype`: generic code over
/// [`Element`] instantiated for whichever dtype a payload holds.
///
/// ```
/// use routed_experts::dtype::{with_element, DType};
///
/// let size = with_element!(DType::U16, T => std::mem::size_of::<T>());
/// assert_eq!(size, 2);
/// ```
#[doc(hidden)]
#[macro_export]
macro_rules! __with_element {
    ($dtype:expr, $t:ident => $body:expr) => {
        match $dtype {
            $crate::dtype::DType::U8 => {
                type $t = u8;
                $body
            }
            $crate::dtype::DType::I8 => {
                type $t = i8;
                $body
            }
            $crate::dtype::DType::U16 => {
                type $t = u16;
                $body
            }
            $crate::dtype::DType::I16 => {
                type $t = i16;
                $body
            }
            $crate::dtype::DType::U32 => {
                type $t = u32;
                $body
            }
            $crate::dtype::DType::I32 => {
                type $t = i32;
                $body
            }
            $crate::dtype::DType::I64 => {
                type $t = i64;
                $body
            }
        }
    };
}
#[doc(inline)]
pub use crate::__with_element as with_element;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn promotion_never_narrows() {
        for a in DType::ALL {
            for b in DType::ALL {
                let p = DType::promote(a, b);
                assert!(p.min() <= a.min().min(b.min()) && p.max() >= a.max().max(b.max()));
            }
        }
        assert_eq!(DType::promote(DType::U8, DType::U16), DType::U16);
        assert_eq!(DType::promote(DType::U8, DType::I8), DType::I16);
        assert_eq!(DType::promote(DType::U16, DType::I16), DType::I32);
        assert_eq!(DType::promote(DType::U8, DType::U8), DType::U8);
    }

    #[test]
    fn compact_choice() {
        assert_eq!(DType::compact_for_range(0, 255).unwrap(), DType::U8);
        assert_eq!(DType::compact_for_range(0, 256).unwrap(), DType::U16);
        assert_eq!(DType::compact_for_range(-1, 300).unwrap(), DType::I16);
        assert_eq!(DType::compact_for_range(-1, 40000).unwrap(), DType::I32);
        assert!(DType::compact_for_range(0, i64::MAX).is_err());
        assert_eq!(DType::for_num_experts(256).unwrap(), DType::U8);
        assert_eq!(DType::for_num_experts(384).unwrap(), DType::U16);
    }

    #[test]
    fn names_round_trip() {
        for d in DType::ALL {
            assert_eq!(DType::parse(d.name()).unwrap(), d);
        }
        assert!(DType::parse("float32").is_err());
    }
}
