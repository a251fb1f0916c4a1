//! The one error type of pq-core. Every public function checks its arguments and returns
//! [`PqError`] instead of panicking.
use core::fmt;

/// [`crate::kmeans::MAX_K`] (checked equal there), for the messages: this bottom module imports
/// no other.
pub(crate) const MAX_CLUSTERS: usize = 1 << 16;

/// Bad parameters or inputs to a pq-core function.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum PqError {
    /// The vector dimension (`dim`) is zero.
    ZeroDim,
    /// The number of sub-spaces `m` is zero.
    ZeroSubspaces,
    /// `dim` is not a multiple of the number of sub-spaces `m`.
    DimNotDivisible {
        /// The vector dimension.
        dim: usize,
        /// The number of sub-spaces.
        m: usize,
    },
    /// Bits per code outside `1..=max`.
    BitsOutOfRange {
        /// The requested bits per code.
        b: u8,
        /// The largest accepted value.
        max: u8,
    },
    /// A flat `[n, dim]` buffer whose length is not a multiple of `dim`.
    LengthNotMultiple {
        /// The buffer length.
        len: usize,
        /// The row length it must be a multiple of.
        dim: usize,
    },
    /// A buffer has the wrong length.
    LengthMismatch {
        /// The length given.
        got: usize,
        /// The length required.
        expected: usize,
    },
    /// No data points / keys were given where at least one is needed.
    Empty,
    /// An input value is NaN or infinite.
    NonFinite {
        /// Index of the first offending value in the flat input.
        index: usize,
    },
    /// The number of clusters `k` is zero or above [`crate::kmeans::MAX_K`].
    ClustersOutOfRange {
        /// The requested number of clusters.
        k: usize,
    },
    /// A code does not fit in the codebook / bit width (`code > max`).
    CodeOutOfRange {
        /// Index of the code in the flat code buffer.
        index: usize,
        /// The code.
        code: u16,
        /// The largest valid code.
        max: u16,
    },
    /// The padding bits after the last packed code are not all zero (non-canonical stream).
    NonZeroPadding,
    /// A fraction with a zero denominator.
    ZeroDenominator,
    /// More tokens than indices fit in a `u32`, or a size computation overflowed `usize`.
    TooLarge,
    /// A block size of zero tokens ([`crate::cache::blocks_of`]).
    ZeroBlockTokens,
    /// More books (codes per key) than a codebook accepts.
    TooManyBooks {
        /// The requested number of books.
        m: usize,
        /// The largest accepted value.
        max: usize,
    },
    /// A k-means run or a codebook of more centroid values (clusters or codewords times their
    /// dimensions) than [`crate::kmeans::MAX_CENTROID_VALUES`].
    TooManyCentroidValues {
        /// The largest accepted count.
        max: usize,
    },
    /// A re-ranking candidate index is not a token of the keys given.
    CandidateOutOfRange {
        /// The candidate token index.
        index: u32,
        /// The number of tokens.
        tokens: usize,
    },
}

impl fmt::Display for PqError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::ZeroDim => write!(f, "vector dimension is zero"),
            Self::ZeroSubspaces => write!(f, "number of sub-spaces is zero"),
            Self::DimNotDivisible { dim, m } => {
                write!(f, "dimension {dim} is not a multiple of the {m} sub-spaces")
            }
            Self::BitsOutOfRange { b, max } => write!(f, "{b} bits per code, expected 1..={max}"),
            Self::LengthNotMultiple { len, dim } => {
                write!(
                    f,
                    "buffer of {len} values is not a multiple of the row length {dim}"
                )
            }
            Self::LengthMismatch { got, expected } => {
                write!(f, "buffer of {got} values, expected {expected}")
            }
            Self::Empty => write!(f, "no data points"),
            Self::NonFinite { index } => write!(f, "value at index {index} is NaN or infinite"),
            Self::ClustersOutOfRange { k } => {
                write!(f, "{k} clusters, expected 1..={MAX_CLUSTERS}")
            }
            Self::CodeOutOfRange { index, code, max } => {
                write!(f, "code {code} at index {index} exceeds the maximum {max}")
            }
            Self::NonZeroPadding => write!(f, "non-zero padding bits after the last code"),
            Self::ZeroDenominator => write!(f, "fraction with a zero denominator"),
            Self::TooLarge => write!(f, "size overflow or more than u32::MAX tokens"),
            Self::ZeroBlockTokens => write!(f, "block size of zero tokens"),
            Self::TooManyBooks { m, max } => write!(f, "{m} books per key, expected 1..={max}"),
            Self::TooManyCentroidValues { max } => write!(
                f,
                "more than {max} centroid values (clusters or codewords times their dimensions)"
            ),
            Self::CandidateOutOfRange { index, tokens } => {
                write!(
                    f,
                    "candidate token {index} is not below the {tokens} tokens given"
                )
            }
        }
    }
}

#[cfg(feature = "std")]
impl std::error::Error for PqError {}
