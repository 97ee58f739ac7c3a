//! Quantization against a reference decoded apart from the kernels (nibbles
//! and bytes read with plain integer arithmetic, errors measured in f64), on
//! every path this CPU has and at several thread counts.

use super::*;

/// A deterministic spread of magnitudes and signs (xorshift).
fn values(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut s = seed | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let u = (s >> 40) as f32 / (1u64 << 24) as f32; // [0, 1)
            (u - 0.5) * scale * if s & 1 == 0 { 1.0 } else { 0.01 }
        })
        .collect()
}

/// The codes of `q`, decoded with plain integer arithmetic.
fn codes(q: &Quantized) -> Vec<i32> {
    (0..q.len)
        .map(|i| match q.bits {
            Bits::Int8 => i32::from(q.data[i] as i8),
            Bits::Int4 => {
                let nibble = i32::from((q.data[i / 2] >> (4 * (i % 2))) & 0x0f);
                if nibble >= 8 {
                    nibble - 16
                } else {
                    nibble
                }
            }
        })
        .collect()
}

/// Checks `q` against `x`: every scale is the block's max |x| / qmax (to
/// within the next representable steps), every code is within range and
/// within half a step of x / s, every dequantized value within the stated
/// bound. Returns the largest error seen, in steps.
fn check(x: &[f32], q: &Quantized, what: &str) -> f64 {
    assert_eq!(q.len, x.len(), "{what}");
    assert_eq!(q.scales.len(), x.len().div_ceil(q.block_size), "{what}");
    let codes = codes(q);
    let mut back = vec![f32::NAN; x.len()];
    dequantize(q, &mut back);
    let qmax = f64::from(q.bits.qmax());
    let mut worst = 0f64;
    for (b, block) in x.chunks(q.block_size).enumerate() {
        let s = f64::from(q.scales[b]);
        let amax = block.iter().map(|v| f64::from(v.abs())).fold(0.0, f64::max);
        if amax == 0.0 {
            assert_eq!(s, 0.0, "{what} block {b}: a zero block's scale");
        } else if q.scales[b] < f32::MIN_POSITIVE {
            // A subnormal scale has few bits: it only has to cover the block.
            assert!(
                amax / s < qmax + 0.5,
                "{what} block {b}: scale {s} for max |x| {amax}"
            );
        } else {
            assert!(
                (amax / s - qmax).abs() <= qmax * 1e-6,
                "{what} block {b}: scale {s} for max |x| {amax}"
            );
        }
        for (i, &v) in block.iter().enumerate() {
            let k = b * q.block_size + i;
            let code = codes[k];
            assert!(f64::from(code.abs()) <= qmax, "{what} [{k}]: code {code}");
            let err = (f64::from(v) - f64::from(back[k])).abs();
            let bound = error_bound(q.bits, q.scales[b]);
            assert!(
                err <= bound,
                "{what} [{k}]: {v} came back as {} (error {err:e}, bound {bound:e})",
                back[k]
            );
            assert_eq!(
                back[k],
                (f64::from(code) * s) as f32,
                "{what} [{k}]: not code × scale"
            );
            if s > 0.0 {
                worst = worst.max(err / s);
            }
        }
    }
    worst
}

const LENGTHS: [usize; 7] = [1, 2, 3, 63, 64, 1001, 40_961];

#[test]
fn every_value_comes_back_within_half_a_step() {
    for bits in [Bits::Int8, Bits::Int4] {
        let mut worst_of_all = 0f64;
        for &n in &LENGTHS {
            for block in [2, 64, 2048] {
                let x = values(n, n as u64 * 31 + block as u64, 3.0);
                let q = quantize(&x, bits, block).unwrap();
                let worst = check(&x, &q, &format!("{bits:?} n {n} block {block}"));
                assert!(worst <= 0.5 + 1e-4, "{worst} steps");
                worst_of_all = worst_of_all.max(worst);
            }
        }
        // Rounding to the nearest code does err by up to half a step, and
        // f32's rounding of x / s and of code × s adds at most qmax·ε more:
        // a bound looser than twice that allowance would let a wrong code
        // pass `check`.
        assert!(
            worst_of_all > 0.49,
            "{bits:?}: at most {worst_of_all} steps"
        );
        let allowance = f64::from(bits.qmax()) * f64::from(f32::EPSILON);
        for s in [1e-30f32, 1e-3, 1.0, 7.5e20] {
            let bound = error_bound(bits, s) / f64::from(s);
            assert!(
                (0.5 + allowance..=0.5 + 2.0 * allowance).contains(&bound),
                "{bits:?}: error_bound at scale {s} is {bound} steps"
            );
        }
    }
}

#[test]
fn bit_counts_name_their_widths() {
    assert_eq!(Bits::from_count(8), Some(Bits::Int8));
    assert_eq!(Bits::from_count(4), Some(Bits::Int4));
    for other in [0, 2, 16, 32] {
        assert_eq!(Bits::from_count(other), None, "{other} bits");
    }
}

/// A communicator's thread quantizes (qwZ, qgZ) while the training thread,
/// on rayon's pool, waits for it: were that thread to hand its blocks to the
/// pool, it would wait for workers that all wait for it. Here every worker of
/// the global pool waits for the quantizing thread, which starts only once
/// they all do; each gives up after a deadline, so a deadlock fails the test
/// instead of hanging it.
#[test]
fn a_thread_off_the_pool_quantizes_alone_while_the_pool_waits_for_it() {
    use std::sync::mpsc;
    use std::sync::{Arc, Mutex};
    use std::time::Duration;
    assert!(rayon::current_thread_index().is_none());
    let workers = rayon::current_num_threads();
    // Several tasks' worth of blocks, so that the pool would be asked.
    let x = values(BLOCKS_PER_TASK * 64 * 4 * workers.max(2), 11, 3.0);
    let want = quantize_with(Path::Portable, &x, Bits::Int8, 64).unwrap();
    let (waiting_tx, waiting_rx) = mpsc::channel::<()>();
    let (done_tx, done_rx) = mpsc::channel::<()>();
    let quantizer = std::thread::spawn(move || {
        for _ in 0..workers {
            waiting_rx.recv().expect("a worker says it waits");
        }
        let q = quantize(&x, Bits::Int8, 64);
        for _ in 0..workers {
            let _ = done_tx.send(());
        }
        q
    });
    let waiting_tx = Mutex::new(waiting_tx);
    let done_rx = Arc::new(Mutex::new(done_rx));
    let waited: Vec<bool> = rayon::broadcast(|_| {
        waiting_tx.lock().unwrap().send(()).unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match done_rx
                .lock()
                .unwrap()
                .recv_timeout(left.min(Duration::from_millis(50)))
            {
                Ok(()) => return true,
                Err(_) if left.is_zero() => return false,
                Err(_) => {}
            }
        }
    });
    let q = quantizer.join().unwrap().unwrap();
    assert!(
        waited.iter().all(|&w| w),
        "the pool's workers waited out their deadline: the quantizing thread used the pool"
    );
    assert!(q == want, "the codes of one thread");
}

#[test]
fn int4_packs_the_earlier_value_in_the_low_nibble() {
    // Scale 1/7: codes 7, -7, 1, -1, 0, 3.
    let x = [1.0, -1.0, 1.0 / 7.0, -1.0 / 7.0, 0.0, 3.0 / 7.0];
    let q = quantize(&x, Bits::Int4, 8).unwrap();
    assert_eq!(q.data, vec![0x97, 0xf1, 0x30]);
    let q = quantize(&x, Bits::Int8, 8).unwrap();
    assert_eq!(q.data, vec![127, 0x81, 18, 0xee, 0, 54]);
}

#[test]
fn zero_constant_and_subnormal_blocks() {
    for bits in [Bits::Int8, Bits::Int4] {
        let zeros = vec![0.0f32; 100];
        let q = quantize(&zeros, bits, 64).unwrap();
        assert_eq!(q.scales, vec![0.0, 0.0]);
        // Every code of a zero block is written, as zero.
        assert!(q.data.iter().all(|&b| b == 0), "{bits:?}: {:?}", q.data);
        check(&zeros, &q, "zeros");
        for c in [1.0f32, -3.5e7, 1e-30] {
            let x = vec![c; 70];
            check(
                &x,
                &quantize(&x, bits, 64).unwrap(),
                &format!("constant {c}"),
            );
        }
        let tiny = f32::from_bits(1); // the smallest subnormal
        for x in [
            vec![tiny; 6],
            vec![tiny, -tiny, 0.0, 3.0 * tiny, 1e-40, -2e-39],
            vec![f32::MIN_POSITIVE, -f32::MIN_POSITIVE / 3.0, 1e-44, 0.0],
        ] {
            let q = quantize(&x, bits, 2).unwrap();
            check(&x, &q, &format!("subnormal {x:?}"));
        }
        let huge = vec![f32::MAX, -f32::MAX, 1.0, f32::MAX / 2.0];
        check(&huge, &quantize(&huge, bits, 4).unwrap(), "f32::MAX");
    }
}

#[test]
fn nan_and_infinity_are_refused_where_they_are() {
    let mut x = values(100_000, 5, 1.0);
    for (at, bad) in [
        (0, f32::NAN),
        (77_777, f32::INFINITY),
        (99_999, -f32::INFINITY),
    ] {
        let keep = x[at];
        x[at] = bad;
        for bits in [Bits::Int8, Bits::Int4] {
            for path in Path::available() {
                let e = quantize_with(path, &x, bits, 2048).unwrap_err();
                match e {
                    QuantError::NonFinite { index, value } => {
                        assert_eq!(index, at, "{path:?}");
                        assert_eq!(value.to_bits(), bad.to_bits());
                    }
                    e => panic!("{e}"),
                }
            }
        }
        x[at] = keep;
    }
}

#[test]
fn every_path_and_thread_count_gives_the_same_bits() {
    let x = values(300_001, 9, 50.0);
    let checked = Path::available();
    for bits in [Bits::Int8, Bits::Int4] {
        // Off any pool: the test's own thread does every block.
        assert!(rayon::current_thread_index().is_none());
        let want = quantize_with(Path::Portable, &x, bits, 2048).unwrap();
        let mut want_back = vec![0f32; x.len()];
        dequantize_with(Path::Portable, &want, &mut want_back);
        for &path in &checked {
            for threads in [1, 3] {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap();
                let (q, back) = pool.install(|| {
                    let q = quantize_with(path, &x, bits, 2048).unwrap();
                    let mut back = vec![0f32; x.len()];
                    dequantize_with(path, &q, &mut back);
                    (q, back)
                });
                assert!(q == want, "{bits:?} {path:?} {threads} threads: codes");
                let same = back
                    .iter()
                    .zip(&want_back)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{bits:?} {path:?} {threads} threads: dequantized");
            }
        }
    }
    let missing: Vec<Path> = Path::ALL
        .into_iter()
        .filter(|p| !checked.contains(p))
        .collect();
    // Past the harness's capture, so that a run says what it covered.
    use std::io::Write;
    let _ = writeln!(
        std::io::stderr(),
        "quantization paths checked here: {checked:?}; not on this CPU, unchecked: {missing:?}"
    );
}

#[test]
fn the_wire_form_round_trips_and_is_checked() {
    let x = values(5001, 3, 2.0);
    for bits in [Bits::Int8, Bits::Int4] {
        let q = quantize(&x, bits, 256).unwrap();
        let bytes = q.to_bytes();
        assert_eq!(bytes.len(), Quantized::wire_len(bits, 256, x.len()));
        assert_eq!(
            Quantized::from_bytes(bits, 256, x.len(), &bytes).unwrap(),
            q
        );
        let short = Quantized::from_bytes(bits, 256, x.len(), &bytes[1..]).unwrap_err();
        assert!(matches!(short, QuantError::WireLength { .. }), "{short}");
    }
    // int8 is 1 byte a value plus 4 per block: 2048-blocks cost 0.2% more.
    assert_eq!(Quantized::wire_len(Bits::Int8, 2048, 4096), 4096 + 8);
    assert_eq!(Quantized::wire_len(Bits::Int4, 2048, 4097), 2049 + 12);
}

#[test]
fn odd_or_zero_block_sizes_are_refused() {
    for block in [0, 1, 3, 2047] {
        assert_eq!(
            quantize(&[1.0; 8], Bits::Int8, block).unwrap_err(),
            QuantError::BlockSize(block)
        );
    }
}

/// Error feedback fused ([`quantize_compensated`]) against the same steps
/// done apart with the plain kernels: the kept errors widened, added, the
/// sum quantized, its codes dequantized, the errors updated and narrowed
/// to 8 bits. The codes and the kept errors agree to the bit, on every
/// path, int8 and int4, odd lengths and a last short block, with no
/// errors kept yet, with errors kept, with errors kept for another length
/// (which start from zero), and through a zero block; a non-finite sum is
/// refused where it is and forgets the errors.
#[test]
fn compensated_quantizing_is_the_steps_done_apart() {
    let apart = |x: &[f32], kept: &Option<Quantized>, beta: f32, bits: Bits, block: usize| {
        let mut e = vec![0f32; x.len()];
        if let Some(k) = kept.as_ref().filter(|k| k.len == x.len()) {
            dequantize(k, &mut e);
        }
        let c: Vec<f32> = x.iter().zip(&e).map(|(v, e)| v + e).collect();
        let q = quantize(&c, bits, block).unwrap();
        let mut d = vec![0f32; x.len()];
        dequantize(&q, &mut d);
        for ((e, c), d) in e.iter_mut().zip(&c).zip(&d) {
            *e = beta * *e + (1.0 - beta) * (c - d);
        }
        (q, quantize(&e, Bits::Int8, block).unwrap())
    };
    for path in Path::available() {
        for bits in [Bits::Int8, Bits::Int4] {
            for len in [1, 37, 64, 1000, 4097] {
                let what = format!("{path:?} {bits:?} {len}");
                let mut fused: Option<Quantized> = None;
                let mut reference: Option<Quantized> = None;
                for round in 0..4u64 {
                    let mut x = values(len, 7 + round, 3.0);
                    if round == 2 {
                        x[..len.min(64)].fill(0.0);
                    }
                    let (q, e) = apart(&x, &reference, 0.8, bits, 64);
                    let got =
                        quantize_compensated_with(path, &x, &mut fused, 0.8, bits, 64).unwrap();
                    assert_eq!(got, q, "{what} round {round}: codes");
                    assert_eq!(fused.as_ref(), Some(&e), "{what} round {round}: errors");
                    // (One value is its block's largest, which comes back
                    // exactly; round 2 zeroes the first block.)
                    if len > 64 || (len > 1 && round != 2) {
                        assert!(e.scales.iter().any(|&s| s > 0.0), "{what}: no error kept");
                    }
                    reference = Some(e);
                }
                // Errors kept for another length start from zero.
                let x = values(len + 2, 99, 3.0);
                let (q, e) = apart(&x, &None, 0.8, bits, 64);
                let got = quantize_compensated_with(path, &x, &mut fused, 0.8, bits, 64).unwrap();
                assert_eq!((got, fused.clone()), (q, Some(e)), "{what}: another length");
                let mut bad = x.clone();
                bad[len / 2] = f32::INFINITY;
                let err = quantize_compensated_with(path, &bad, &mut fused, 0.8, bits, 64);
                assert!(
                    matches!(err, Err(QuantError::NonFinite { index, .. }) if index == len / 2),
                    "{what}: {err:?}"
                );
                assert!(fused.is_none(), "{what}: errors kept past a non-finite sum");
            }
        }
    }
}
