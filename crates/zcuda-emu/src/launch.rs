//! The launchers of `cpp/emu.cpp` and safe wrappers that check each
//! kernel's extents before the call.

use std::os::raw::{c_float, c_int, c_uint, c_ulonglong, c_ushort};

extern "C" {
    fn emu_set_warp_order(order: c_int);
    fn emu_probe_broadcast_unsynced(out: *mut c_int, blocks: c_uint, threads: c_uint);
    fn emu_probe_gather_unsynced(out: *mut c_int, blocks: c_uint, threads: c_uint);
    fn emu_flash_forward(
        qkv: *const c_float,
        first: *const c_uint,
        out: *mut c_float,
        out16: *mut u16,
        fmt16: c_int,
        lse: *mut c_float,
        b: c_int,
        t: c_int,
        heads: c_int,
        kv: c_int,
        hd: c_int,
        ld: c_int,
        scale: c_float,
        kind: c_int,
        threshold: c_uint,
        dscale: c_float,
        key: c_uint,
    );
    fn emu_flash_backward(
        qkv: *const c_float,
        first: *const c_uint,
        out: *const c_float,
        dout: *const c_float,
        lse: *const c_float,
        delta: *mut c_float,
        dqkv: *mut c_float,
        b: c_int,
        t: c_int,
        heads: c_int,
        kv: c_int,
        hd: c_int,
        ld: c_int,
        scale: c_float,
        kind: c_int,
        threshold: c_uint,
        dscale: c_float,
        key: c_uint,
    );
    fn emu_quantize(
        x: *const c_float,
        n: c_ulonglong,
        block_size: c_uint,
        bits: c_int,
        scales: *mut c_float,
        data: *mut u8,
        bad: *mut c_ulonglong,
    );
    fn emu_dequantize(
        scales: *const c_float,
        data: *const u8,
        n: c_ulonglong,
        block_size: c_uint,
        bits: c_int,
        out: *mut c_float,
    );
    fn emu_adamw(
        p: *mut c_float,
        g: *const std::ffi::c_void,
        m: *mut c_float,
        v: *mut c_float,
        working: *mut c_ushort,
        n: c_ulonglong,
        c: *const zcuda::AdamConsts,
        grad_fmt: c_int,
        working_fmt: c_int,
    );
    fn emu_add_into16(acc: *mut c_ushort, x: *const c_float, n: c_ulonglong, fmt: c_int);
    fn emu_widen16(out: *mut c_float, x: *const c_ushort, n: c_ulonglong, fmt: c_int);
    fn emu_round16(out: *mut c_ushort, x: *const c_float, n: c_ulonglong, fmt: c_int);
    fn emu_sum_sq_chunks(
        x: *const std::ffi::c_void,
        n: c_ulonglong,
        chunk: c_ulonglong,
        scale: c_float,
        out: *mut f64,
        fmt: c_int,
    );
    fn emu_layer_norm(
        x: *const c_float,
        w: *const c_float,
        b: *const c_float,
        y: *mut c_float,
        y16: *mut u16,
        fmt16: c_int,
        mean: *mut c_float,
        rstd: *mut c_float,
        n: c_int,
        d: c_int,
        eps: c_float,
    );
    fn emu_rms_norm(
        x: *const c_float,
        w: *const c_float,
        y: *mut c_float,
        y16: *mut u16,
        fmt16: c_int,
        rstd: *mut c_float,
        n: c_int,
        d: c_int,
        eps: c_float,
    );
    fn emu_rms_norm_backward(
        x: *const c_float,
        w: *const c_float,
        rstd: *const c_float,
        dy: *const c_float,
        dres: *const c_float,
        dx: *mut c_float,
        dw: *mut c_float,
        n: c_int,
        d: c_int,
    );
    fn emu_swiglu(
        h: *const c_float,
        y: *mut c_float,
        y16: *mut u16,
        fmt16: c_int,
        n: c_ulonglong,
        f: c_int,
    );
    fn emu_swiglu_backward(
        h: *const c_float,
        dy: *const c_float,
        dh: *mut c_float,
        n: c_ulonglong,
        f: c_int,
    );
    fn emu_rope(
        x: *mut c_float,
        cos: *const c_float,
        sin: *const c_float,
        first: *const c_uint,
        rows: c_ulonglong,
        ld: c_int,
        heads: c_int,
        hd: c_int,
        half: c_int,
        t: c_int,
        sign: c_float,
    );
    fn emu_kv_rows_to_heads(
        rows: *const c_float,
        ld: c_int,
        col0: c_int,
        heads: *mut c_float,
        b: c_int,
        t: c_int,
        h: c_int,
        hd: c_int,
        group: c_int,
    );
    fn emu_heads_to_kv_rows(
        heads: *const c_float,
        rows: *mut c_float,
        ld: c_int,
        col0: c_int,
        b: c_int,
        t: c_int,
        h: c_int,
        hd: c_int,
        group: c_int,
    );
    fn emu_embed(
        tok: *const c_uint,
        wte: *const c_float,
        wpe: *const c_float,
        first: *const c_uint,
        x: *mut c_float,
        n: c_ulonglong,
        t: c_int,
        d: c_int,
    );
    fn emu_layer_norm_backward(
        x: *const c_float,
        w: *const c_float,
        mean: *const c_float,
        rstd: *const c_float,
        dy: *const c_float,
        dres: *const c_float,
        dx: *mut c_float,
        dw: *mut c_float,
        db: *mut c_float,
        n: c_int,
        d: c_int,
    );
    fn emu_column_sums(
        a: *const c_float,
        a16: *mut u16,
        fmt16: c_int,
        out: *mut c_float,
        n: c_int,
        width: c_int,
    );
    fn emu_gelu(h: *const c_float, g: *mut c_float, g16: *mut u16, fmt16: c_int, n: c_ulonglong);
    fn emu_gelu_backward(h: *const c_float, dg: *const c_float, dh: *mut c_float, n: c_ulonglong);
    fn emu_causal_softmax(
        probs: *const c_float,
        s: *mut c_float,
        s16: *mut c_ushort,
        fmt16: c_int,
        first: *const c_uint,
        n: c_ulonglong,
        t: c_int,
        heads: c_int,
        scale: c_float,
        threshold: c_uint,
        dscale: c_float,
        key: c_uint,
    );
    fn emu_cross_entropy(
        logits: *mut c_float,
        targets: *const c_uint,
        loss: *mut c_float,
        g16: *mut c_ushort,
        fmt16: c_int,
        n: c_int,
        vocab: c_int,
        coef: c_float,
        smoothing: c_float,
        grad: c_int,
    );
    fn emu_embed_backward(
        dx: *const c_float,
        present: *const c_uint,
        start: *const c_uint,
        rows_by_token: *const c_uint,
        tokens: c_int,
        dwte: *mut c_float,
        dwpe: *mut c_float,
        b: c_int,
        t: c_int,
        d: c_int,
    );
    fn emu_rows_to_heads(
        rows: *const c_float,
        ld: c_int,
        col0: c_int,
        heads: *mut c_float,
        b: c_int,
        t: c_int,
        h: c_int,
        hd: c_int,
    );
    fn emu_heads_to_rows(
        heads: *const c_float,
        rows: *mut c_float,
        ld: c_int,
        col0: c_int,
        b: c_int,
        t: c_int,
        h: c_int,
        hd: c_int,
    );
    fn emu_bias_residual(
        y: *mut c_float,
        b: *const c_float,
        res: *const c_float,
        n: c_ulonglong,
        width: c_int,
        threshold: c_uint,
        scale: c_float,
        key: c_uint,
    );
    fn emu_dropout_noise(
        x: *const c_float,
        y: *mut c_float,
        n: c_ulonglong,
        threshold: c_uint,
        scale: c_float,
        key: c_uint,
        mag: c_float,
        noise_key: c_uint,
    );
}

/// Which warp of a block runs ahead of the others to each barrier (see
/// `cpp/emu_fiber.h`): each order shows the races between warps that the
/// other hides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WarpOrder {
    /// Warp 0 first, then 1, ... (the default, `ZCUDA_EMU_WARP_ORDER`
    /// unset or `forward`).
    Forward,
    /// The last warp first (`ZCUDA_EMU_WARP_ORDER=reverse`).
    Reverse,
}

/// `f` with this thread's launches in `order`, then back to the process's
/// default.
pub fn with_warp_order<R>(order: WarpOrder, f: impl FnOnce() -> R) -> R {
    let code = match order {
        WarpOrder::Forward => 0,
        WarpOrder::Reverse => 1,
    };
    // SAFETY: sets a field of this OS thread's emulation state.
    unsafe { emu_set_warp_order(code) };
    let r = f();
    // SAFETY: as above.
    unsafe { emu_set_warp_order(-1) };
    r
}

/// The race probes of `cpp/emu.cpp` over `blocks` blocks of `threads`
/// (whole warps, at most 1024): a block's values that thread 0 sets and
/// every thread reads with no barrier between (`[blocks × threads]`), and
/// per block the sum of the slots that each warp's lane 0 sets (warp w:
/// w + 1) and thread 0 adds with no barrier between (`[blocks]`).
pub fn race_probes(blocks: usize, threads: usize) -> (Vec<i32>, Vec<i32>) {
    assert!(threads.is_multiple_of(32) && (32..=1024).contains(&threads));
    let mut broadcast = vec![0; blocks * threads];
    let mut gathered = vec![0; blocks];
    // SAFETY: each launch writes `blocks × threads` and `blocks` values.
    unsafe {
        emu_probe_broadcast_unsynced(broadcast.as_mut_ptr(), blocks as c_uint, threads as c_uint);
        emu_probe_gather_unsynced(gathered.as_mut_ptr(), blocks as c_uint, threads as c_uint);
    }
    (broadcast, gathered)
}

fn int(v: usize) -> c_int {
    c_int::try_from(v).expect("a size that fits the kernels' int")
}

fn ptr_or_null<T>(v: Option<&[T]>) -> *const T {
    v.map_or(std::ptr::null(), <[T]>::as_ptr)
}

/// Panics unless `first` (where given) says, for each of `rows` tokens in
/// sequences of `t`, where its document begins as the kernels read it
/// ([`zcuda::check_documents`]).
fn check_firsts(first: Option<&[u32]>, rows: usize, t: usize) {
    if let Some(first) = first {
        assert!(rows.is_multiple_of(t), "documents: {rows} rows of {t}");
        if let Err(e) = zcuda::check_documents(first, rows / t, t) {
            panic!("{e}");
        }
    }
}

/// Layer norm of `x`'s rows of `w.len()`: (y, mean, rstd); with `y16`, y's
/// 16-bit values written there instead (y left at zero).
pub fn layer_norm(
    x: &[f32],
    w: &[f32],
    b: &[f32],
    eps: f32,
    y16: Option<Out16<'_>>,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (d, n) = (w.len(), x.len() / w.len());
    assert!(b.len() == d && x.len() == n * d, "layer norm: shapes");
    let (y16, fmt16) = out16(y16, n * d);
    let (mut y, mut mean, mut rstd) = (vec![0.0; n * d], vec![0.0; n], vec![0.0; n]);
    // SAFETY: x and y (and y16, if not null) hold n·d values, w and b d,
    // mean and rstd n (checked and allocated above): the kernel's extents
    // for one block per row.
    unsafe {
        emu_layer_norm(
            x.as_ptr(),
            w.as_ptr(),
            b.as_ptr(),
            y.as_mut_ptr(),
            y16,
            fmt16,
            mean.as_mut_ptr(),
            rstd.as_mut_ptr(),
            int(n),
            int(d),
            eps,
        )
    };
    (y, mean, rstd)
}

/// RMSNorm of `x`'s rows of `w.len()`: (y, 1/rms per row); with `y16`,
/// y's 16-bit values written there instead (y left at zero).
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, y16: Option<Out16<'_>>) -> (Vec<f32>, Vec<f32>) {
    let (d, n) = (w.len(), x.len() / w.len());
    assert_eq!(x.len(), n * d, "rms norm: shapes");
    let (y16, fmt16) = out16(y16, n * d);
    let (mut y, mut rstd) = (vec![0.0; n * d], vec![0.0; n]);
    // SAFETY: x and y (and y16, if not null) hold n·d values, w d, rstd n
    // (checked and allocated above).
    unsafe {
        emu_rms_norm(
            x.as_ptr(),
            w.as_ptr(),
            y.as_mut_ptr(),
            y16,
            fmt16,
            rstd.as_mut_ptr(),
            int(n),
            int(d),
            eps,
        )
    };
    (y, rstd)
}

/// RMSNorm's backward: (dx [+ dres], dw).
pub fn rms_norm_backward(
    x: &[f32],
    w: &[f32],
    rstd: &[f32],
    dy: &[f32],
    dres: Option<&[f32]>,
) -> (Vec<f32>, Vec<f32>) {
    let (d, n) = (w.len(), x.len() / w.len());
    assert!(
        x.len() == n * d && dy.len() == n * d && rstd.len() == n,
        "rms norm backward: shapes"
    );
    assert!(
        dres.is_none_or(|r| r.len() == n * d),
        "rms norm backward: dres"
    );
    let (mut dx, mut dw) = (vec![0.0; n * d], vec![0.0; d]);
    // SAFETY: every buffer holds the extent the kernels read or write for n
    // rows of d (checked and allocated above); dres is null or n·d values.
    unsafe {
        emu_rms_norm_backward(
            x.as_ptr(),
            w.as_ptr(),
            rstd.as_ptr(),
            dy.as_ptr(),
            ptr_or_null(dres),
            dx.as_mut_ptr(),
            dw.as_mut_ptr(),
            int(n),
            int(d),
        )
    };
    (dx, dw)
}

/// SwiGLU of `h`'s rows of `[gate | up]` (`2f` wide): `[n, f]`; with
/// `y16`, its 16-bit values written there instead (the result left at zero).
pub fn swiglu(h: &[f32], f: usize, y16: Option<Out16<'_>>) -> Vec<f32> {
    let n = h.len() / (2 * f);
    assert_eq!(h.len(), n * 2 * f, "swiglu: shapes");
    let (y16, fmt16) = out16(y16, n * f);
    let mut y = vec![0.0; n * f];
    // SAFETY: h holds n·2f values, y (and y16, if not null) n·f (checked
    // and allocated above).
    unsafe { emu_swiglu(h.as_ptr(), y.as_mut_ptr(), y16, fmt16, n as u64, int(f)) };
    y
}

/// SwiGLU's backward: dh `[n, 2f]` from h and dy `[n, f]`.
pub fn swiglu_backward(h: &[f32], dy: &[f32], f: usize) -> Vec<f32> {
    let n = h.len() / (2 * f);
    assert!(
        h.len() == n * 2 * f && dy.len() == n * f,
        "swiglu backward: shapes"
    );
    let mut dh = vec![0.0; n * 2 * f];
    // SAFETY: h and dh hold n·2f values, dy n·f (checked and allocated above).
    unsafe { emu_swiglu_backward(h.as_ptr(), dy.as_ptr(), dh.as_mut_ptr(), n as u64, int(f)) };
    dh
}

/// The rotary turn of the first `2·half` columns of each of the first
/// `heads` heads of `hd` in rows of `ld`, in place, at positions `row % t`
/// (or, with `first`, from each row's document's first row), with tables
/// `[t_max, half]`; `sign` −1 turns back.
#[allow(clippy::too_many_arguments)]
pub fn rope(
    x: &mut [f32],
    cos: &[f32],
    sin: &[f32],
    first: Option<&[u32]>,
    ld: usize,
    heads: usize,
    (hd, half): (usize, usize),
    t: usize,
    sign: f32,
) {
    let rows = x.len() / ld;
    assert!(
        x.len() == rows * ld && heads * hd <= ld && 2 * half <= hd,
        "rope: shapes"
    );
    check_firsts(first, rows, t);
    assert!(
        cos.len() >= t * half && sin.len() == cos.len(),
        "rope: tables"
    );
    // SAFETY: x holds rows·ld values with heads·hd ≤ ld and 2·half ≤ hd,
    // the tables t·half at least (positions below t): the kernel's extents
    // (checked above).
    unsafe {
        emu_rope(
            x.as_mut_ptr(),
            cos.as_ptr(),
            sin.as_ptr(),
            ptr_or_null(first),
            rows as u64,
            int(ld),
            int(heads),
            int(hd),
            int(half),
            int(t),
            sign,
        )
    };
}

/// Key/value heads in columns `col0..` of rows `[b, t, ld]` as `[b·h, t,
/// hd]`, query head `j` getting key/value head `j / group`.
#[allow(clippy::too_many_arguments)]
pub fn kv_rows_to_heads(
    rows: &[f32],
    ld: usize,
    col0: usize,
    b: usize,
    t: usize,
    h: usize,
    hd: usize,
    group: usize,
) -> Vec<f32> {
    assert!(
        rows.len() == b * t * ld && col0 + h / group * hd <= ld,
        "kv rows to heads: shapes"
    );
    let mut heads = vec![0.0; b * h * t * hd];
    // SAFETY: rows holds b·t·ld values with col0 + (h/group)·hd ≤ ld, heads
    // b·h·t·hd (checked and allocated above).
    unsafe {
        emu_kv_rows_to_heads(
            rows.as_ptr(),
            int(ld),
            int(col0),
            heads.as_mut_ptr(),
            int(b),
            int(t),
            int(h),
            int(hd),
            int(group),
        )
    };
    heads
}

/// Its backward into `rows` (columns `col0..col0 + h/group·hd` written):
/// each key/value head the sum of its group's query heads.
#[allow(clippy::too_many_arguments)]
pub fn heads_to_kv_rows(
    heads: &[f32],
    rows: &mut [f32],
    ld: usize,
    col0: usize,
    b: usize,
    t: usize,
    h: usize,
    hd: usize,
    group: usize,
) {
    assert!(
        heads.len() == b * h * t * hd && rows.len() == b * t * ld && col0 + h / group * hd <= ld,
        "heads to kv rows: shapes"
    );
    // SAFETY: as in kv_rows_to_heads, the other way (checked above).
    unsafe {
        emu_heads_to_kv_rows(
            heads.as_ptr(),
            rows.as_mut_ptr(),
            int(ld),
            int(col0),
            int(b),
            int(t),
            int(h),
            int(hd),
            int(group),
        )
    };
}

/// The embedding of `tokens` (rows of `t` positions): `wte[token]`, plus
/// `wpe[position]` where given (positions from each token's document's
/// first with `first`).
pub fn embed(
    tokens: &[u32],
    wte: &[f32],
    wpe: Option<&[f32]>,
    first: Option<&[u32]>,
    t: usize,
    d: usize,
) -> Vec<f32> {
    let n = tokens.len();
    check_firsts(first, n, t);
    let vocab = wte.len() / d;
    assert!(
        tokens.iter().all(|&k| (k as usize) < vocab) && wpe.is_none_or(|p| p.len() >= t * d),
        "embed: tokens or tables"
    );
    let mut x = vec![0.0; n * d];
    // SAFETY: tokens below vocab, wpe (or null) t·d values at least, x n·d
    // (checked and allocated above).
    unsafe {
        emu_embed(
            tokens.as_ptr(),
            wte.as_ptr(),
            ptr_or_null(wpe),
            ptr_or_null(first),
            x.as_mut_ptr(),
            n as u64,
            int(t),
            int(d),
        )
    };
    x
}

/// A dropout's (threshold, scale, key), as gpt.cu's kernels take them
/// (zcuda's `Mask`; a threshold of 0 drops nothing).
pub type MaskArgs = (u32, f32, u32);

/// `y = drop(y (+ b)) (+ res)` over rows of `width`, in place, `mask`
/// dropping the branch before the residual add.
pub fn bias_residual(
    y: &mut [f32],
    b: Option<&[f32]>,
    res: Option<&[f32]>,
    width: usize,
    mask: Option<MaskArgs>,
) {
    let n = y.len() / width;
    assert!(
        b.is_none_or(|b| b.len() == width) && res.is_none_or(|r| r.len() == y.len()),
        "bias residual: shapes"
    );
    let (threshold, scale, key) = mask.unwrap_or((0, 1.0, 0));
    // SAFETY: y holds n·width values, b (or null) width, res (or null) as
    // many as y (checked above).
    unsafe {
        emu_bias_residual(
            y.as_mut_ptr(),
            ptr_or_null(b),
            ptr_or_null(res),
            n as u64,
            int(width),
            threshold,
            scale,
            key,
        )
    };
}

/// `y` dropped by `mask` in place (gpt.cu's `dropout_noise` without `x`).
pub fn dropout_in_place(y: &mut [f32], (threshold, scale, key): MaskArgs) {
    // SAFETY: y holds y.len() values; a null x means in place on y.
    unsafe {
        emu_dropout_noise(
            std::ptr::null(),
            y.as_mut_ptr(),
            y.len() as u64,
            threshold,
            scale,
            key,
            0.0,
            0,
        )
    };
}

/// `drop(x + noise)` element by element: NEFTune's noise of `(magnitude,
/// key)` where given, then `mask` where given.
pub fn dropout_noise(x: &[f32], mask: Option<MaskArgs>, noise: Option<(f32, u32)>) -> Vec<f32> {
    let mut y = vec![0.0; x.len()];
    let (threshold, scale, key) = mask.unwrap_or((0, 1.0, 0));
    let (mag, noise_key) = noise.unwrap_or((0.0, 0));
    // SAFETY: x and y hold x.len() values each.
    unsafe {
        emu_dropout_noise(
            x.as_ptr(),
            y.as_mut_ptr(),
            x.len() as u64,
            threshold,
            scale,
            key,
            mag,
            noise_key,
        )
    };
    y
}

/// Layer norm's backward from its (mean, rstd): (dx [+ dres], dw, db).
pub fn layer_norm_backward(
    x: &[f32],
    w: &[f32],
    (mean, rstd): (&[f32], &[f32]),
    dy: &[f32],
    dres: Option<&[f32]>,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (d, n) = (w.len(), x.len() / w.len());
    assert!(
        x.len() == n * d && dy.len() == n * d && mean.len() == n && rstd.len() == n,
        "layer norm backward: shapes"
    );
    assert!(
        dres.is_none_or(|r| r.len() == n * d),
        "layer norm backward: dres"
    );
    let (mut dx, mut dw, mut db) = (vec![0.0; n * d], vec![0.0; d], vec![0.0; d]);
    // SAFETY: every buffer holds the extent the kernels read or write for n
    // rows of d (checked and allocated above); dres is null or n·d values.
    unsafe {
        emu_layer_norm_backward(
            x.as_ptr(),
            w.as_ptr(),
            mean.as_ptr(),
            rstd.as_ptr(),
            dy.as_ptr(),
            ptr_or_null(dres),
            dx.as_mut_ptr(),
            dw.as_mut_ptr(),
            db.as_mut_ptr(),
            int(n),
            int(d),
        )
    };
    (dx, dw, db)
}

/// The column sums of `a`'s rows of `width`, as a bias gradient is taken;
/// with `a16`, `a` rounded into it in the same pass.
pub fn column_sums(a: &[f32], width: usize, a16: Option<Out16<'_>>) -> Vec<f32> {
    let n = a.len() / width;
    assert_eq!(a.len(), n * width, "column sums: shapes");
    let (a16, fmt16) = out16(a16, a.len());
    let mut out = vec![0.0; width];
    // SAFETY: a (and a16, if not null) holds n·width values, out width
    // (checked and allocated above).
    unsafe { emu_column_sums(a.as_ptr(), a16, fmt16, out.as_mut_ptr(), int(n), int(width)) };
    out
}

/// GPT-2's GELU of every value; with `g16`, its 16-bit values written
/// there instead (the result left at zero).
pub fn gelu(h: &[f32], g16: Option<Out16<'_>>) -> Vec<f32> {
    let (g16, fmt16) = out16(g16, h.len());
    let mut g = vec![0.0; h.len()];
    // SAFETY: h and g (and g16, if not null) hold h.len() values.
    unsafe { emu_gelu(h.as_ptr(), g.as_mut_ptr(), g16, fmt16, h.len() as u64) };
    g
}

/// A kernel's 16-bit output for the products that read it next: its
/// format and where its values go.
pub type Out16<'a> = (Fmt16, &'a mut [u16]);

/// A kernel's optional 16-bit output of `len` values, as the (pointer,
/// format) it takes (null: f32 output).
fn out16(out: Option<Out16<'_>>, len: usize) -> (*mut u16, c_int) {
    match out {
        Some((fmt, b)) => {
            assert_eq!(b.len(), len, "a 16-bit output of {len} values");
            (b.as_mut_ptr(), fmt as c_int)
        }
        None => (std::ptr::null_mut(), 0),
    }
}

/// GELU's backward: `gelu'(h)·dg`.
pub fn gelu_backward(h: &[f32], dg: &[f32]) -> Vec<f32> {
    assert_eq!(h.len(), dg.len(), "gelu backward: shapes");
    let mut dh = vec![0.0; h.len()];
    // SAFETY: h, dg and dh hold h.len() values (checked and allocated above).
    unsafe { emu_gelu_backward(h.as_ptr(), dg.as_ptr(), dh.as_mut_ptr(), h.len() as u64) };
    dh
}

/// The causal softmax of `s`'s rows of `t` (row `r` is row `r % t` of a
/// `t × t` matrix) in place, scores times `scale`; with `probs`, its
/// backward (dP in, dS out). With `s16`, the result's 16-bit values are
/// written there too (the backward's instead of into `s`). With `first`
/// (per token of `[b, t]`, where its document begins), row `i` of head `h`
/// of sequence `b` (`heads` a sequence) sees keys from its document's
/// first. The forward's 16-bit values are dropped by `mask` first
/// (attention's dropout; `s` keeps the undropped probabilities).
#[allow(clippy::too_many_arguments)]
pub fn causal_softmax(
    s: &mut [f32],
    probs: Option<&[f32]>,
    s16: Option<Out16<'_>>,
    first: Option<&[u32]>,
    heads: usize,
    t: usize,
    scale: f32,
    mask: Option<MaskArgs>,
) {
    let n = s.len() / t;
    assert!(
        s.len() == n * t && probs.is_none_or(|p| p.len() == s.len()) && n.is_multiple_of(t * heads),
        "causal softmax: shapes"
    );
    check_firsts(first, n / heads, t);
    let (s16, fmt16) = out16(s16, s.len());
    let (threshold, dscale, key) = mask.unwrap_or((0, 1.0, 0));
    // SAFETY: s (and probs, and s16) hold n rows of t (checked above).
    unsafe {
        emu_causal_softmax(
            ptr_or_null(probs),
            s.as_mut_ptr(),
            s16,
            fmt16,
            ptr_or_null(first),
            n as u64,
            int(t),
            int(heads),
            scale,
            threshold,
            dscale,
            key,
        )
    };
}

/// Cross-entropy of `logits`' rows of `vocab` against `targets`, label
/// smoothed by `smoothing` (0: none): each row's loss; with `coef`, the row
/// becomes its gradient times `coef` in place, or with `g16` too, that
/// gradient's 16-bit values go there instead.
pub fn cross_entropy(
    logits: &mut [f32],
    targets: &[u32],
    vocab: usize,
    (coef, smoothing): (Option<f32>, f32),
    g16: Option<Out16<'_>>,
) -> Vec<f32> {
    let n = targets.len();
    assert!(
        logits.len() == n * vocab && targets.iter().all(|&k| (k as usize) < vocab),
        "cross entropy: shapes"
    );
    let mut loss = vec![0.0; n];
    let (g16, fmt16) = out16(g16, logits.len());
    // SAFETY: logits (and g16) hold n rows of vocab, targets are below
    // vocab, loss n values (checked and allocated above).
    unsafe {
        emu_cross_entropy(
            logits.as_mut_ptr(),
            targets.as_ptr(),
            loss.as_mut_ptr(),
            g16,
            fmt16,
            int(n),
            int(vocab),
            coef.unwrap_or(0.0),
            smoothing,
            i32::from(coef.is_some()),
        )
    };
    loss
}

/// The embedding's backward from `dx` `[b, t, d]` and the rows grouped by
/// token (`zcuda::rows_by_token`): (dwte `[vocab, d]`, dwpe `[t, d]`).
#[allow(clippy::too_many_arguments)]
pub fn embed_backward(
    dx: &[f32],
    (present, start, rows): (&[u32], &[u32], &[u32]),
    vocab: usize,
    b: usize,
    t: usize,
    d: usize,
) -> (Vec<f32>, Vec<f32>) {
    assert!(
        dx.len() == b * t * d
            && start.len() == present.len() + 1
            && rows.len() == b * t
            && present.iter().all(|&k| (k as usize) < vocab)
            && rows.iter().all(|&r| (r as usize) < b * t),
        "embed backward: shapes"
    );
    let (mut dwte, mut dwpe) = (vec![0.0; vocab * d], vec![0.0; t * d]);
    // SAFETY: the tokens present are below vocab and the rows below b·t,
    // dx holds b·t·d values, dwte vocab·d, dwpe t·d (checked above).
    unsafe {
        emu_embed_backward(
            dx.as_ptr(),
            present.as_ptr(),
            start.as_ptr(),
            rows.as_ptr(),
            int(present.len()),
            dwte.as_mut_ptr(),
            dwpe.as_mut_ptr(),
            int(b),
            int(t),
            int(d),
        )
    };
    (dwte, dwpe)
}

/// Columns `col0..col0 + h·hd` of rows `[b, t, ld]` as `[b·h, t, hd]`, or
/// (`back`) the other way into `rows`.
#[allow(clippy::too_many_arguments)]
pub fn relayout_heads(
    rows: &mut [f32],
    heads: &mut [f32],
    back: bool,
    ld: usize,
    col0: usize,
    b: usize,
    t: usize,
    h: usize,
    hd: usize,
) {
    assert!(
        rows.len() == b * t * ld && heads.len() == b * t * h * hd && col0 + h * hd <= ld,
        "relayout: shapes"
    );
    let ints = [ld, col0, b, t, h, hd].map(int);
    // SAFETY: rows hold b·t·ld values with col0 + h·hd ≤ ld, heads b·h·t·hd
    // (checked above).
    unsafe {
        match back {
            false => emu_rows_to_heads(
                rows.as_ptr(),
                ints[0],
                ints[1],
                heads.as_mut_ptr(),
                ints[2],
                ints[3],
                ints[4],
                ints[5],
            ),
            true => emu_heads_to_rows(
                heads.as_ptr(),
                rows.as_mut_ptr(),
                ints[0],
                ints[1],
                ints[2],
                ints[3],
                ints[4],
                ints[5],
            ),
        }
    };
}

/// A 16-bit format of `kernels/half16.cuh` (`FMT_BF16`, `FMT_F16`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fmt16 {
    /// bfloat16.
    Bf16 = 1,
    /// IEEE binary16.
    F16 = 2,
}

/// `acc[i] = round(widen(acc[i]) + x[i])` in `fmt` (reduce.cu's `add_into16`).
pub fn add_into16(fmt: Fmt16, acc: &mut [u16], x: &[f32]) {
    assert_eq!(acc.len(), x.len(), "add_into16: lengths");
    // SAFETY: both hold x.len() values (checked above).
    unsafe { emu_add_into16(acc.as_mut_ptr(), x.as_ptr(), x.len() as u64, fmt as c_int) };
}

/// The f32 values of 16-bit `x` (reduce.cu's `widen16_into`).
pub fn widen16(fmt: Fmt16, x: &[u16]) -> Vec<f32> {
    let mut out = vec![0f32; x.len()];
    // SAFETY: out holds x.len() values (allocated above).
    unsafe { emu_widen16(out.as_mut_ptr(), x.as_ptr(), x.len() as u64, fmt as c_int) };
    out
}

/// `x` rounded to nearest even in `fmt` (reduce.cu's `round16_into`).
pub fn round16(fmt: Fmt16, x: &[f32]) -> Vec<u16> {
    let mut out = vec![0u16; x.len()];
    // SAFETY: out holds x.len() values (allocated above).
    unsafe { emu_round16(out.as_mut_ptr(), x.as_ptr(), x.len() as u64, fmt as c_int) };
    out
}

/// Gradients for reduce.cu's norm: f32 values, or 16-bit ones in a format.
pub enum Grads<'a> {
    /// f32 values.
    F32(&'a [f32]),
    /// 16-bit values, as bits.
    Half(Fmt16, &'a [u16]),
}

/// The sums of squares of `x·scale` over chunks of `chunk` values (a
/// multiple of 8; reduce.cu's `sum_sq_chunks`).
pub fn sum_sq_chunks(x: Grads<'_>, chunk: usize, scale: f32) -> Vec<f64> {
    assert!(
        chunk > 0 && chunk.is_multiple_of(8),
        "sum_sq_chunks: chunks of {chunk}"
    );
    let (ptr, n, fmt) = match x {
        Grads::F32(v) => (v.as_ptr().cast::<std::ffi::c_void>(), v.len(), 0),
        Grads::Half(f, v) => (v.as_ptr().cast(), v.len(), f as c_int),
    };
    let mut out = vec![0f64; n.div_ceil(chunk)];
    if n == 0 {
        return out;
    }
    // SAFETY: x holds n values of the format fmt names; out one per chunk.
    unsafe { emu_sum_sq_chunks(ptr, n as u64, chunk as u64, scale, out.as_mut_ptr(), fmt) };
    out
}

/// One AdamW step of adamw.cu over `p`, `m`, `v` with gradient `g`, and with
/// `working` the updated `p` rounded to 16 bits there; Lion's or Adagrad's
/// (`c.rule`) with `v` empty.
pub fn adamw(
    p: &mut [f32],
    g: Grads<'_>,
    m: &mut [f32],
    v: &mut [f32],
    working: Option<(Fmt16, &mut [u16])>,
    c: &zcuda::AdamConsts,
) {
    let n = p.len();
    let (gptr, glen, grad_fmt) = match g {
        Grads::F32(x) => (x.as_ptr().cast::<std::ffi::c_void>(), x.len(), 0),
        Grads::Half(f, x) => (x.as_ptr().cast(), x.len(), f as c_int),
    };
    assert!(
        glen == n
            && m.len() == n
            && v.len()
                == match c.rule {
                    zcuda::RULE_ADAMW | zcuda::RULE_ADAM => n,
                    _ => 0,
                }
            && working.as_ref().is_none_or(|w| w.1.len() == n),
        "adamw: buffer lengths differ"
    );
    // Lion and Adagrad keep no second moment: the kernel gets null, as
    // from zcuda.
    let vptr = match v.is_empty() {
        true => std::ptr::null_mut(),
        false => v.as_mut_ptr(),
    };
    let (wptr, working_fmt) = match working {
        Some((f, w)) => (w.as_mut_ptr(), f as c_int),
        None => (std::ptr::null_mut(), 0),
    };
    // SAFETY: every buffer holds n values (checked above; v none or null
    // under Lion and Adagrad, whose updates never touch it), the gradient in
    // the format grad_fmt names, the working copy only when working_fmt is
    // not 0; c is adamw.cu's AdamConsts (zcuda's repr(C) twin).
    unsafe {
        emu_adamw(
            p.as_mut_ptr(),
            gptr,
            m.as_mut_ptr(),
            vptr,
            wptr,
            n as u64,
            c,
            grad_fmt,
            working_fmt,
        )
    };
}

/// quantize.cu's blockwise quantization of `x` with `bits` (8 or 4) per
/// value in blocks of `block_size` (even): the scales and the data bytes,
/// or the lowest index of a NaN or an infinity.
pub fn quantize(x: &[f32], bits: u32, block_size: usize) -> Result<(Vec<f32>, Vec<u8>), u64> {
    assert!(
        (bits == 8 || bits == 4) && block_size > 0 && block_size.is_multiple_of(2),
        "quantize: {bits} bits, blocks of {block_size}"
    );
    let n = x.len();
    let mut scales = vec![0f32; n.div_ceil(block_size)];
    let mut data = vec![0u8; if bits == 8 { n } else { n.div_ceil(2) }];
    let mut bad = u64::MAX;
    if n > 0 {
        // SAFETY: x holds n values, scales one per block, data the bytes
        // of n values at `bits`; one block per quantization block.
        unsafe {
            emu_quantize(
                x.as_ptr(),
                n as u64,
                int(block_size) as c_uint,
                bits as c_int,
                scales.as_mut_ptr(),
                data.as_mut_ptr(),
                &mut bad,
            )
        };
    }
    match bad {
        u64::MAX => Ok((scales, data)),
        i => Err(i),
    }
}

/// quantize.cu's dequantization of `n` values.
pub fn dequantize(scales: &[f32], data: &[u8], n: usize, bits: u32, block_size: usize) -> Vec<f32> {
    assert!(
        scales.len() == n.div_ceil(block_size)
            && data.len() == if bits == 8 { n } else { n.div_ceil(2) },
        "dequantize: shapes"
    );
    let mut out = vec![0f32; n];
    // SAFETY: scales, data and out hold what n values need (checked above).
    unsafe {
        emu_dequantize(
            scales.as_ptr(),
            data.as_ptr(),
            n as u64,
            int(block_size) as c_uint,
            bits as c_int,
            out.as_mut_ptr(),
        )
    };
    out
}

/// The shape of `attention.cu`'s fused attention: `b` sequences of `t`
/// rows, `heads` query heads of `hd` (16, 32 or 64) on `kv` key/value heads,
/// q, k and v side by side in rows of `(heads + 2·kv)·hd`; and its kind of
/// products.
#[derive(Clone, Copy, Debug)]
pub struct FlashShape {
    pub b: usize,
    pub t: usize,
    pub heads: usize,
    pub kv: usize,
    pub hd: usize,
    pub products: FlashProducts,
}

/// The fused attention's products: bf16 or f16 (m16n8k16), or TF32
/// (m16n8k8).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum FlashProducts {
    Bf16,
    Tf32,
    F16,
}

impl FlashShape {
    fn check(&self) {
        let FlashShape {
            b,
            t,
            heads,
            kv,
            hd,
            ..
        } = *self;
        let widths: &[usize] = match self.products {
            FlashProducts::Tf32 => &[16, 32, 64],
            FlashProducts::Bf16 | FlashProducts::F16 => &[16, 32, 64, 128],
        };
        assert!(
            b > 0 && t > 0 && kv > 0 && heads.is_multiple_of(kv) && widths.contains(&hd),
            "fused attention: shape {self:?}"
        );
    }

    fn ld(&self) -> usize {
        (self.heads + 2 * self.kv) * self.hd
    }

    fn scale(&self) -> f32 {
        1.0 / (self.hd as f32).sqrt()
    }

    fn kind(&self) -> c_int {
        match self.products {
            FlashProducts::Bf16 => 0,
            FlashProducts::Tf32 => 1,
            FlashProducts::F16 => 2,
        }
    }
}

/// The fused causal attention of `qkv` `[b, t, (heads + 2·kv)·hd]`: the
/// output `[b, t, heads·hd]` and each row's log-sum-exp `[b·heads, t]`;
/// with `rounded`, the output's 16-bit values written there too; with
/// `first`, each row attends from its document's first row; with `mask`,
/// the probabilities dropped by it (the `_dropout` kernels).
pub fn flash_attention(
    qkv: &[f32],
    first: Option<&[u32]>,
    sh: FlashShape,
    rounded: Option<Out16<'_>>,
    mask: Option<MaskArgs>,
) -> (Vec<f32>, Vec<f32>) {
    sh.check();
    check_firsts(first, sh.b * sh.t, sh.t);
    let (rows, ld) = (sh.b * sh.t, sh.ld());
    assert_eq!(qkv.len(), rows * ld, "fused attention: qkv");
    let mut out = vec![0.0; rows * sh.heads * sh.hd];
    let mut lse = vec![0.0; rows * sh.heads];
    let (out16, fmt16) = out16(rounded, out.len());
    let (threshold, dscale, key) = flash_mask(mask);
    // SAFETY: qkv holds b·t rows of ld, out (and out16, if not null)
    // b·t·heads·hd values and lse b·heads·t (checked and allocated above);
    // hd is one of the kernel's.
    unsafe {
        emu_flash_forward(
            qkv.as_ptr(),
            ptr_or_null(first),
            out.as_mut_ptr(),
            out16,
            fmt16,
            lse.as_mut_ptr(),
            int(sh.b),
            int(sh.t),
            int(sh.heads),
            int(sh.kv),
            int(sh.hd),
            int(ld),
            sh.scale(),
            sh.kind(),
            threshold,
            dscale,
            key,
        )
    };
    (out, lse)
}

/// Its backward: dqkv `[b, t, (heads + 2·kv)·hd]` from the forward's input,
/// output and log-sum-exp and the output's gradient (`mask` the forward's).
#[allow(clippy::too_many_arguments)]
pub fn flash_attention_backward(
    qkv: &[f32],
    first: Option<&[u32]>,
    out: &[f32],
    lse: &[f32],
    dout: &[f32],
    sh: FlashShape,
    mask: Option<MaskArgs>,
) -> Vec<f32> {
    sh.check();
    check_firsts(first, sh.b * sh.t, sh.t);
    let (rows, ld) = (sh.b * sh.t, sh.ld());
    let width = sh.heads * sh.hd;
    assert!(
        qkv.len() == rows * ld
            && out.len() == rows * width
            && dout.len() == rows * width
            && lse.len() == rows * sh.heads,
        "fused attention backward: shapes"
    );
    let mut delta = vec![0.0; rows * sh.heads];
    let mut dqkv = vec![f32::NAN; rows * ld];
    let (threshold, dscale, key) = flash_mask(mask);
    // SAFETY: as the forward, with out and dout b·t·heads·hd values and
    // delta b·heads·t (checked and allocated above).
    unsafe {
        emu_flash_backward(
            qkv.as_ptr(),
            ptr_or_null(first),
            out.as_ptr(),
            dout.as_ptr(),
            lse.as_ptr(),
            delta.as_mut_ptr(),
            dqkv.as_mut_ptr(),
            int(sh.b),
            int(sh.t),
            int(sh.heads),
            int(sh.kv),
            int(sh.hd),
            int(ld),
            sh.scale(),
            sh.kind(),
            threshold,
            dscale,
            key,
        )
    };
    dqkv
}

/// The fused kernels' mask arguments: a threshold of 0 (none) runs the
/// kernels without dropout.
fn flash_mask(mask: Option<MaskArgs>) -> MaskArgs {
    if let Some((threshold, _, _)) = mask {
        assert!(threshold > 0, "fused attention: a mask drops something");
    }
    mask.unwrap_or((0, 1.0, 0))
}
