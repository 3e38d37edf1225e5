//! `experts_forward` against a plain f64 reference over dequantized weights, on both kernel paths, and its input
//! checks.

use rand::{rngs::StdRng, Rng, SeedableRng};

use crate::e4m3::E4M3;
use crate::executor::Form;
use crate::*;

const E2M1: [f64; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];

fn bf16(v: f32) -> u16 {
    (v.to_bits() >> 16) as u16
}

fn from_bf16(b: u16) -> f64 {
    f32::from_bits((b as u32) << 16) as f64
}

/// One NVFP4 projection's codes, scales and globals.
type Tensors = (Vec<u8>, Vec<u8>, Vec<f32>);

fn projection(t: &Tensors, strides: [usize; 3]) -> Nvfp4Projection<'_> {
    Nvfp4Projection {
        codes: Strided { data: &t.0, expert_stride: strides[0] },
        scales: Strided { data: &t.1, expert_stride: strides[1] },
        globals: Strided { data: &t.2, expert_stride: strides[2] },
    }
}

/// A bank's tensors, owned; `stride_pad` extra elements between experts (a strided view, as the offload rows are).
struct Owned {
    shape: Shape,
    bf16: Option<(Vec<u16>, Vec<u16>)>,
    nvfp4: Option<[Tensors; 2]>,
    pad: usize,
}

impl Owned {
    fn random_bf16(shape: Shape, rng: &mut StdRng) -> Owned {
        let Shape { experts: e, hidden: h, intermediate: i } = shape;
        let w = |n: usize, fan_in: usize, rng: &mut StdRng| -> Vec<u16> {
            (0..n).map(|_| bf16(rng.gen_range(-1.0..1.0) / (fan_in as f32).sqrt())).collect()
        };
        Owned { shape, bf16: Some((w(e * 2 * i * h, h, rng), w(e * h * i, i, rng))), nvfp4: None, pad: 0 }
    }

    /// NVFP4 with every code and scales over [2^-3, 2^3); expert e's tensors at a stride of `pad` more elements.
    fn random_nvfp4(shape: Shape, pad: usize, rng: &mut StdRng) -> Owned {
        let Shape { experts: e, hidden: h, intermediate: i } = shape;
        let proj = |rows: usize, k: usize, rng: &mut StdRng| {
            let codes = (0..e * (rows * k / 2 + pad)).map(|_| rng.gen()).collect();
            let scales = (0..e * (rows * k / 16 + pad)).map(|_| rng.gen_range(0x20..0x58)).collect();
            let globals = (0..e * (rows + pad)).map(|_| rng.gen_range(0.5..1.5) / (k as f32).sqrt()).collect();
            (codes, scales, globals)
        };
        let gate_up = proj(2 * i, h, rng);
        let down = proj(h, i, rng);
        Owned { shape, bf16: None, nvfp4: Some([gate_up, down]), pad }
    }

    fn bank(&self) -> Bank<'_> {
        let e = self.shape.experts;
        if let Some((gu, d)) = &self.bf16 {
            return Bank::Bf16 { gate_up: Strided::contiguous(gu, e), down: Strided::contiguous(d, e) };
        }
        let [gu, d] = self.nvfp4.as_ref().unwrap();
        let strides = |t: &Tensors| [t.0.len() / e, t.1.len() / e, t.2.len() / e];
        Bank::Nvfp4 { gate_up: projection(gu, strides(gu)), down: projection(d, strides(d)) }
    }

    /// Weight `[row, col]` of expert e's gate|up (`down == false`) or down projection.
    fn weight(&self, down: bool, e: usize, row: usize, col: usize) -> f64 {
        let Shape { hidden: h, intermediate: i, .. } = self.shape;
        let k = if down { i } else { h };
        if let Some((gu, d)) = &self.bf16 {
            let w = if down { d } else { gu };
            let per = if down { h * i } else { 2 * i * h };
            return from_bf16(w[e * per + row * k + col]);
        }
        let (codes, scales, globals) = &self.nvfp4.as_ref().unwrap()[down as usize];
        let rows = if down { h } else { 2 * i };
        let byte = codes[e * (rows * k / 2 + self.pad) + (row * k + col) / 2];
        let code = (byte >> (4 * (col % 2))) & 15;
        let value = if code & 8 != 0 { -E2M1[(code & 7) as usize] } else { E2M1[code as usize] };
        let scale = E4M3[scales[e * (rows * k / 16 + self.pad) + (row * k + col) / 16] as usize] as f64;
        value * scale * globals[e * (rows + self.pad) + row] as f64
    }

    /// What the kernels of `form` compute, in f64: every form but f32 rounds the activations to BF16 before the
    /// down projection, and the int16 form takes x and the activations through its blocks.
    fn reference(&self, x: &[u16], pairs: &[Pair], out: &mut [f64], form: Form) {
        let Shape { hidden: h, intermediate: i, .. } = self.shape;
        let round = |v: f64| if form != Form::F32 { from_bf16(crate::forward::round_to_bf16(v as f32)) } else { v };
        let blocks = |v: Vec<f64>| if form == Form::Int16 { through_int16(&v) } else { v };
        for p in pairs {
            let (t, e) = (p.token as usize, p.expert as usize);
            let xt = blocks(x[t * h..(t + 1) * h].iter().map(|b| from_bf16(*b)).collect());
            let dot = |row: usize| (0..h).map(|c| self.weight(false, e, row, c) * xt[c]).sum::<f64>();
            let act = blocks((0..i).map(|r| round((dot(r) / (1.0 + (-dot(r)).exp())) * dot(i + r))).collect());
            for r in 0..h {
                let v: f64 = (0..i).map(|c| self.weight(true, e, r, c) * act[c]).sum();
                out[t * h + r] += p.weight as f64 * v;
            }
        }
    }
}

/// `v` quantized to int16 blocks and back (`nvfp4_int16_dot::quantize`; its own tests check it against exact
/// values).
fn through_int16(v: &[f64]) -> Vec<f64> {
    let pad = v.len().div_ceil(256) * 256;
    let (mut values, mut factors) = (vec![0i16; pad], vec![0f32; pad / 16]);
    crate::nvfp4_int16_dot::quantize(v.len(), v.iter().map(|x| *x as f32), &mut values, &mut factors);
    (0..v.len()).map(|j| values[crate::nvfp4_int16_dot::position(j)] as f64 * factors[j / 16] as f64 * 2.0).collect()
}

fn random_pairs(tokens: usize, k: usize, experts: usize, rng: &mut StdRng) -> Vec<Pair> {
    let mut pairs = Vec::new();
    for t in 0..tokens {
        for _ in 0..k {
            // few experts, so that tokens share them (groups of several pairs)
            let expert = rng.gen_range(0..experts.min(3)) as u32;
            pairs.push(Pair { token: t as u32, expert, weight: rng.gen_range(0.1..1.0) });
        }
    }
    pairs
}

fn check(bank: &Owned, tokens: usize, k: usize, seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    let h = bank.shape.hidden;
    let x: Vec<u16> = (0..tokens * h).map(|_| bf16(rng.gen_range(-1.0..1.0))).collect();
    let pairs = random_pairs(tokens, k, bank.shape.experts, &mut rng);
    let start: Vec<f32> = (0..tokens * h).map(|_| rng.gen_range(-1.0..1.0)).collect();
    // every kernel set this CPU runs, on a few thread counts, against the reference of its form (1e-4 outside the f32
    // form: where the kernel's and the reference's activations sit on two sides of a BF16 rounding boundary)
    let executors: Vec<(usize, Kernels, Executor)> = [
        (1, Kernels::Portable),
        (3, Kernels::Avx512),
        (2, Kernels::Avx512Vnni),
        (3, Kernels::Avx512Bf16),
        (2, Kernels::Portable),
    ]
    .into_iter()
    .filter_map(|(threads, kernels)| Some((threads, kernels, Executor::with_kernels(threads, kernels).ok()?)))
    .collect();
    // the reference of each form the executors take (f32 always: the norm below)
    let layout = bank.bank().layout();
    let mut wants: Vec<(Form, Vec<f64>)> = Vec::new();
    for form in std::iter::once(Form::F32).chain(executors.iter().map(|(_, kernels, _)| kernels.form(layout))) {
        if wants.iter().all(|(f, _)| *f != form) {
            let mut want: Vec<f64> = start.iter().map(|v| *v as f64).collect();
            bank.reference(&x, &pairs, &mut want, form);
            wants.push((form, want));
        }
    }
    let want = &wants[0].1;
    let norm = want.iter().map(|v| v * v).sum::<f64>().sqrt();
    let mut results = Vec::new();
    for (threads, kernels, exec) in &executors {
        let mut out = start.clone();
        experts_forward(&bank.bank(), bank.shape, &x, &pairs, &mut out, exec).unwrap();
        let form = kernels.form(layout);
        let want = &wants.iter().find(|(f, _)| *f == form).unwrap().1;
        let tol = if form == Form::F32 { 1e-5 } else { 1e-4 };
        let err = out.iter().zip(want).map(|(o, w)| (*o as f64 - w).powi(2)).sum::<f64>().sqrt() / norm;
        assert!(err < tol, "{:?} T={tokens} threads={threads} {kernels:?}: error {err}", bank.shape);
        if form == Form::F32 {
            results.push(out);
        }
    }
    // the f32 kernels agree element by element (to a rounding of the output's size), whatever the thread count
    let rms = norm / (want.len() as f64).sqrt();
    for out in &results[1..] {
        for (a, b) in out.iter().zip(&results[0]) {
            assert!(((a - b).abs() as f64) <= 1e-5 * (rms + b.abs() as f64), "{a} vs {b}");
        }
    }
}

#[test]
fn bf16_bank_matches_the_reference() {
    let mut rng = StdRng::seed_from_u64(10);
    for (e, h, i) in [(4, 64, 32), (3, 100, 36), (5, 33, 70), (2, 1, 1)] {
        let bank = Owned::random_bf16(Shape { experts: e, hidden: h, intermediate: i }, &mut rng);
        for (tokens, k) in [(1, 1), (3, 2), (5, 4)] {
            check(&bank, tokens, k, 1 + tokens as u64);
        }
    }
}

#[test]
fn nvfp4_bank_matches_the_reference() {
    let mut rng = StdRng::seed_from_u64(11);
    for (e, h, i, pad) in [(4, 256, 128, 0), (3, 272, 48, 16), (5, 16, 16, 3), (2, 512, 272, 0)] {
        let bank = Owned::random_nvfp4(Shape { experts: e, hidden: h, intermediate: i }, pad, &mut rng);
        for (tokens, k) in [(1, 1), (3, 2), (4, 3)] {
            check(&bank, tokens, k, 7 + tokens as u64);
        }
    }
}

#[test]
fn nvfp4_bank_views_with_a_stride() {
    // expert e's tensors start `pad` elements after expert e-1's end, as in the offload rows
    let mut rng = StdRng::seed_from_u64(12);
    let shape = Shape { experts: 3, hidden: 64, intermediate: 32 };
    let owned = Owned::random_nvfp4(shape, 5, &mut rng);
    let [gu, d] = owned.nvfp4.as_ref().unwrap();
    let strides = |rows: usize, k: usize| [rows * k / 2 + 5, rows * k / 16 + 5, rows + 5];
    let bank = Bank::Nvfp4 { gate_up: projection(gu, strides(64, 64)), down: projection(d, strides(64, 32)) };
    let x: Vec<u16> = (0..2 * 64).map(|_| bf16(rng.gen_range(-1.0..1.0))).collect();
    let pairs = [Pair { token: 0, expert: 2, weight: 0.5 }, Pair { token: 1, expert: 1, weight: 1.0 }];
    let mut want = vec![0f64; 2 * 64];
    let exec = Executor::new(2, false).unwrap();
    owned.reference(&x, &pairs, &mut want, exec.kernels().form(bank.layout()));
    let mut out = vec![0f32; 2 * 64];
    experts_forward(&bank, shape, &x, &pairs, &mut out, &exec).unwrap();
    for (o, w) in out.iter().zip(&want) {
        assert!((*o as f64 - w).abs() < 1e-4 * (1.0 + w.abs()), "{o} vs {w}");
    }
}

#[test]
fn bad_inputs_are_errors() {
    let mut rng = StdRng::seed_from_u64(13);
    let shape = Shape { experts: 2, hidden: 32, intermediate: 16 };
    let owned = Owned::random_nvfp4(shape, 0, &mut rng);
    let exec = Executor::new(1, false).unwrap();
    let x = vec![0u16; 2 * 32];
    let mut out = vec![0f32; 2 * 32];
    let ok = Pair { token: 1, expert: 1, weight: 1.0 };
    let run = |shape: Shape, x: &[u16], pairs: &[Pair], out: &mut [f32]| {
        experts_forward(&owned.bank(), shape, x, pairs, out, &exec).unwrap_err()
    };
    let err = run(shape, &x, &[ok, Pair { token: 2, ..ok }], &mut out);
    assert!(err.contains("pair 1: token 2"), "{err}");
    let err = run(shape, &x, &[Pair { expert: 2, ..ok }], &mut out);
    assert!(err.contains("expert 2 is outside the bank's 2 experts"), "{err}");
    let err = run(shape, &x[..63], &[ok], &mut out);
    assert!(err.contains("x has 63 elements"), "{err}");
    let err = run(shape, &x, &[ok], &mut out[..32]);
    assert!(err.contains("out has 32 elements"), "{err}");
    let err = run(Shape { experts: 3, ..shape }, &x, &[ok], &mut out);
    assert!(err.contains("w13: 3 experts of 512 elements at stride 512 need more than 1024"), "{err}");
    let err = run(Shape { hidden: 40, ..shape }, &x, &[ok], &mut out);
    assert!(err.contains("divisible by 16"), "{err}");
    let err = run(Shape { experts: usize::MAX / 4, ..shape }, &x, &[ok], &mut out);
    assert!(err.contains("too large"), "{err}");
    assert!(out.iter().all(|v| *v == 0.0), "an error leaves out as it was");
    // no pairs: nothing to do
    experts_forward(&owned.bank(), shape, &x, &[], &mut out, &exec).unwrap();
}

#[test]
fn call_times_count_each_call_and_the_pool_s_hand_off() {
    let mut rng = StdRng::seed_from_u64(14);
    let shape = Shape { experts: 4, hidden: 64, intermediate: 32 };
    let owned = Owned::random_nvfp4(shape, 0, &mut rng);
    let exec = Executor::new(3, false).unwrap();
    let x: Vec<u16> = (0..2 * 64).map(|_| bf16(rng.gen_range(-1.0..1.0))).collect();
    let pairs: Vec<Pair> = (0..4).map(|e| Pair { token: e % 2, expert: e, weight: 1.0 }).collect();
    let mut out = vec![0f32; 2 * 64];
    let started = std::time::Instant::now();
    for _ in 0..5 {
        experts_forward(&owned.bank(), shape, &x, &pairs, &mut out, &exec).unwrap();
    }
    experts_forward(&owned.bank(), shape, &x, &[], &mut out, &exec).unwrap(); // no pairs: not a call
    let elapsed = started.elapsed().as_nanos() as u64;
    let t = exec.take_times();
    assert_eq!(t.calls, 5);
    assert!(t.phase_ns.iter().sum::<u64>() <= elapsed && t.phase_ns[2] > 0 && t.phase_ns[4] > 0, "{t:?}");
    // 2 tokens and 4 pairs: every phase has several tasks, so each is a broadcast, joined by at most 2 workers
    assert_eq!(t.broadcasts, 5 * 4, "{t:?}");
    assert!(t.joined <= 2 * t.broadcasts && t.wait_ns <= elapsed, "{t:?}");
    assert_eq!(exec.take_times(), Default::default(), "taken: zero again");
}
