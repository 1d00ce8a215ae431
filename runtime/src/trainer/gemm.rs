//! The one place the CPU code calls `matrixmultiply`'s raw-pointer GEMM. Every
//! extent the call relies on is checked here, against the slices themselves,
//! so no caller's promise stands between a malformed batch and a read past a
//! buffer: a wrong shape is an error value.

/// A matrix operand: a slice and the strides (in elements) of its rows and columns.
#[derive(Clone, Copy)]
pub struct View<'a> {
    pub data: &'a [f32],
    pub row_stride: usize,
    pub col_stride: usize,
}

impl<'a> View<'a> {
    /// A row-major `rows x cols` matrix.
    pub fn row_major(data: &'a [f32], cols: usize) -> Self {
        View { data, row_stride: cols, col_stride: 1 }
    }

    /// The transpose of a row-major matrix with `cols` columns.
    pub fn transposed(data: &'a [f32], cols: usize) -> Self {
        View { data, row_stride: 1, col_stride: cols }
    }

    /// Elements a `rows x cols` matrix with these strides reaches (None:
    /// past what memory can hold, or a stride the GEMM cannot take).
    fn extent(&self, rows: usize, cols: usize) -> Option<usize> {
        isize::try_from(self.row_stride).ok()?;
        isize::try_from(self.col_stride).ok()?;
        if rows == 0 || cols == 0 {
            return Some(0);
        }
        (rows - 1)
            .checked_mul(self.row_stride)?
            .checked_add((cols - 1).checked_mul(self.col_stride)?)?
            .checked_add(1)
    }
}

/// Why a product was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("matrix product {m}x{k} * {k}x{n}: {operand} needs {needed} values, has {has}")]
pub struct ShapeError {
    pub m: usize,
    pub k: usize,
    pub n: usize,
    pub operand: &'static str,
    pub needed: usize,
    pub has: usize,
}

/// `C = A B` (`C += A B` when `accumulate`) for `A: m x k`, `B: k x n` and a
/// row-major `C: m x n`.
pub fn gemm(
    m: usize,
    k: usize,
    n: usize,
    a: View<'_>,
    b: View<'_>,
    c: &mut [f32],
    accumulate: bool,
) -> Result<(), ShapeError> {
    let check = |operand, view: Option<View<'_>>, rows: usize, cols: usize, has: usize| {
        let needed = match view {
            Some(v) => v.extent(rows, cols),
            None => rows.checked_mul(cols),
        }
        .unwrap_or(usize::MAX);
        if needed > has { Err(ShapeError { m, k, n, operand, needed, has }) } else { Ok(()) }
    };
    check("A", Some(a), m, k, a.data.len())?;
    check("B", Some(b), k, n, b.data.len())?;
    check("C", None, m, n, c.len())?;
    // Every stride fits an isize: `extent` refuses others, and C's is at most its length.
    let stride = |s: usize| s as isize;
    if m == 0 || n == 0 {
        return Ok(());
    }
    // SAFETY: the checks above prove that every element the strides reach
    // lies inside `a`, `b` and `c`, and that every stride fits an isize;
    // `c` is borrowed mutably, so it overlaps neither `a` nor `b`.
    unsafe {
        matrixmultiply::sgemm(
            m,
            k,
            n,
            1.0,
            a.data.as_ptr(),
            stride(a.row_stride),
            stride(a.col_stride),
            b.data.as_ptr(),
            stride(b.row_stride),
            stride(b.col_stride),
            if accumulate { 1.0 } else { 0.0 },
            c.as_mut_ptr(),
            stride(n),
            1,
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn multiplies_and_transposes() {
        // A = [[1,2,3],[4,5,6]], B = [[1,0],[0,1],[1,1]]
        let a = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let b = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0];
        let mut c = [0.0; 4];
        gemm(2, 3, 2, View::row_major(&a, 3), View::row_major(&b, 2), &mut c, false).unwrap();
        assert_eq!(c, [4.0, 5.0, 10.0, 11.0]);
        // A^T A: 3x3 from A stored 2x3.
        let mut d = [0.0; 9];
        gemm(3, 2, 3, View::transposed(&a, 3), View::row_major(&a, 3), &mut d, false).unwrap();
        assert_eq!(d, [17.0, 22.0, 27.0, 22.0, 29.0, 36.0, 27.0, 36.0, 45.0]);
        gemm(2, 3, 2, View::row_major(&a, 3), View::row_major(&b, 2), &mut c, true).unwrap();
        assert_eq!(c, [8.0, 10.0, 20.0, 22.0]);
    }

    #[test]
    fn every_operand_too_short_is_an_error() {
        let a = [1.0; 5]; // 2x3 needs 6
        let b = [1.0; 6];
        let mut c = [0.0; 4];
        let e = gemm(2, 3, 2, View::row_major(&a, 3), View::row_major(&b, 2), &mut c, false).unwrap_err();
        assert_eq!((e.operand, e.needed, e.has), ("A", 6, 5));
        let e = gemm(2, 3, 2, View::row_major(&b, 3), View::row_major(&a, 2), &mut c, false).unwrap_err();
        assert_eq!((e.operand, e.needed, e.has), ("B", 6, 5));
        let mut short = [0.0; 3];
        let e = gemm(2, 3, 2, View::row_major(&b, 3), View::row_major(&b, 2), &mut short, false).unwrap_err();
        assert_eq!((e.operand, e.needed, e.has), ("C", 4, 3));
        // A transposed view reaches (rows-1)*1 + (cols-1)*stride.
        let e =
            gemm(3, 2, 2, View::transposed(&a, 3), View::row_major(&b, 2), &mut [0.0; 6], false).unwrap_err();
        assert_eq!((e.operand, e.needed), ("A", 6));
        // Absurd extents overflow into an error, not a wrap-around.
        let e = gemm(usize::MAX, 2, 1, View::row_major(&a, 3), View::row_major(&b, 1), &mut c, false)
            .unwrap_err();
        assert_eq!(e.needed, usize::MAX);
        // So do strides past isize, even where one row would not use them.
        let huge = View { data: &a, row_stride: usize::MAX, col_stride: 1 };
        let e = gemm(1, 2, 1, huge, View::row_major(&b, 1), &mut c, false).unwrap_err();
        assert_eq!((e.operand, e.needed), ("A", usize::MAX));
    }
}
