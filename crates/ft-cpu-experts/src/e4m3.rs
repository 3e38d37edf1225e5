//! FP8 E4M3 (`float8_e4m3fn`: bias 7, no infinities, 0x7F / 0xFF are NaN) block scales to f32.

/// f32 value of each of the 256 E4M3 bit patterns.
pub(crate) static E4M3: [f32; 256] = table();

const fn decode(bits: u8) -> f32 {
    let sign = if bits & 0x80 != 0 { -1.0 } else { 1.0 };
    let exp = ((bits >> 3) & 0x0F) as i32;
    let man = (bits & 0x07) as f32;
    if exp == 0x0F && bits & 0x07 == 0x07 {
        return f32::NAN;
    }
    // subnormals (exp 0): man/8 * 2^-6; normals: (1 + man/8) * 2^(exp-7)
    let (frac, e) = if exp == 0 { (man / 8.0, -6) } else { (1.0 + man / 8.0, exp - 7) };
    sign * frac * pow2(e)
}

const fn pow2(e: i32) -> f32 {
    let mut v = 1.0f32;
    let mut i = 0;
    while i < e.abs() {
        v = if e > 0 { v * 2.0 } else { v * 0.5 };
        i += 1;
    }
    v
}

const fn table() -> [f32; 256] {
    let mut t = [0.0f32; 256];
    let mut i = 0;
    while i < 256 {
        t[i] = decode(i as u8);
        i += 1;
    }
    t
}

/// The f32 values of 16 E4M3 bytes, one a lane (AVX-512F). Arithmetic rather than a gather: a normal value's
/// exponent and mantissa bits shifted into an f32's place with the bias moved (+120) by an integer add, a subnormal
/// one (exponent bits 0: mantissa x 2^-9) converted from its mantissa; the sign or-ed back, the two NaN patterns put
/// back as NaN. No f32 subnormal is ever an operand: multiplying one (as this did until 2026-12-07: the shifted bits
/// of a subnormal scale times 2^120) costs a microcode assist, ~3x the whole chunk on a Sapphire Rapids core.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
pub(crate) unsafe fn decode16_avx512(bytes: std::arch::x86_64::__m128i) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    let b = _mm512_cvtepu8_epi32(bytes);
    let magnitude = _mm512_and_si512(b, _mm512_set1_epi32(0x7F));
    let normal = _mm512_add_epi32(_mm512_slli_epi32::<20>(magnitude), _mm512_set1_epi32(120 << 23));
    let mantissa = _mm512_and_si512(magnitude, _mm512_set1_epi32(0x07));
    let small = _mm512_mul_ps(_mm512_cvtepi32_ps(mantissa), _mm512_set1_ps(1.0 / 512.0)); // exact: m x 2^-9
    let subnormal = _mm512_cmplt_epi32_mask(magnitude, _mm512_set1_epi32(0x08)); // zero too: 0 x 2^-9
    let value = _mm512_mask_mov_ps(_mm512_castsi512_ps(normal), subnormal, small);
    let sign = _mm512_slli_epi32::<24>(_mm512_and_si512(b, _mm512_set1_epi32(0x80)));
    let value = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(value), sign));
    let nan = _mm512_cmpeq_epi32_mask(magnitude, _mm512_set1_epi32(0x7F));
    _mm512_mask_mov_ps(value, nan, _mm512_set1_ps(f32::NAN))
}

#[cfg(test)]
mod tests {
    use super::E4M3;

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn simd_decode_equals_the_table() {
        if !std::is_x86_feature_detected!("avx512f") {
            return;
        }
        for start in (0..256).step_by(16) {
            let bytes: [u8; 16] = std::array::from_fn(|i| (start + i) as u8);
            let mut got = [0f32; 16];
            // SAFETY: avx512f was detected above; the load and the store are of 16 bytes / 16 floats in bounds.
            unsafe {
                use std::arch::x86_64::*;
                let v = super::decode16_avx512(_mm_loadu_si128(bytes.as_ptr() as *const __m128i));
                _mm512_storeu_ps(got.as_mut_ptr(), v);
            }
            for (i, g) in got.iter().enumerate() {
                let want = E4M3[start + i];
                assert!(g.to_bits() == want.to_bits() || (g.is_nan() && want.is_nan()), "{:#x}", start + i);
            }
        }
    }

    #[test]
    fn known_values() {
        assert_eq!(E4M3[0x00], 0.0);
        assert_eq!(E4M3[0x01], 2f32.powi(-9)); // the smallest subnormal
        assert_eq!(E4M3[0x08], 2f32.powi(-6)); // the smallest normal
        assert_eq!(E4M3[0x38], 1.0);
        assert_eq!(E4M3[0x3C], 1.5);
        assert_eq!(E4M3[0x7E], 448.0); // the largest finite
        assert_eq!(E4M3[0xB8], -1.0);
        assert!(E4M3[0x7F].is_nan() && E4M3[0xFF].is_nan());
    }
}
