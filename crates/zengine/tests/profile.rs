//! `flops_profiler`'s tree (`Engine::flops_profile`) on real steps: every
//! module of the model is there, its FLOPs add up to the figure the
//! metrics line reports (computed apart, from the parameter groups), its
//! parameters to the model's, and each module's time holds its parts'.

mod common;

use common::{comms, typed_spec};
use zconfig::JobSpec;
use zengine::Engine;
use zmodel::{Batcher, Corpus};
use zproto::ModuleProfile;

/// One profiled step (the second, after one unprofiled) of `spec` on one
/// rank: the tree, the step's tokens, and the engine's FLOPs a token.
fn profiled(spec: &JobSpec) -> (Vec<ModuleProfile>, u64, f64) {
    let t = &spec.train;
    let corpus = Corpus::synthetic(spec.model.vocab_size, t.seed);
    let data = Batcher::new(
        corpus,
        spec.model.seq_len,
        t.micro_batch_size,
        t.grad_accum,
        1,
        0,
        t.seed,
    );
    let mut data = data.unwrap();
    let mut engine = Engine::new(spec, comms(1).remove(0)).unwrap();
    let mut tree = None;
    for s in 0..2 {
        if s == 1 {
            zmodel::profile::start();
        }
        for a in 0..t.grad_accum {
            engine.forward_backward(&data.batch(s, a).unwrap()).unwrap();
        }
        let st = engine.step().unwrap();
        if let Some(times) = zmodel::profile::finish() {
            let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
            let phases = (ms(st.times.forward), ms(st.times.backward));
            let seq = spec.model.seq_len;
            tree = Some((
                engine.flops_profile(&times, st.tokens, seq, phases),
                st.tokens,
            ));
        }
    }
    let (tree, tokens) = tree.expect("the second step was profiled");
    (tree, tokens, engine.flops_per_token())
}

fn row<'a>(tree: &'a [ModuleProfile], path: &str) -> &'a ModuleProfile {
    tree.iter()
        .find(|m| m.path == path)
        .unwrap_or_else(|| panic!("no module {path} in {:?}", paths(tree)))
}

fn paths(tree: &[ModuleProfile]) -> Vec<&str> {
    tree.iter().map(|m| m.path.as_str()).collect()
}

/// The rows below `parent` one depth down (a block's norms and groups, a
/// group's parts).
fn children<'a>(tree: &'a [ModuleProfile], parent: &str) -> Vec<&'a ModuleProfile> {
    let depth = row(tree, parent).depth();
    tree.iter()
        .filter(|m| m.depth() == depth + 1)
        .filter(|m| parent == "model" || m.path.starts_with(&format!("{parent}.")))
        .collect()
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1.0)
}

/// Checks what holds for every tree: sums, nesting, and the model's total.
fn check_sums(tree: &[ModuleProfile], tokens: u64, per_token: f64, param_count: u64) {
    let model = row(tree, "model");
    let total = model.forward_flops + model.backward_flops;
    assert!(
        close(total, tokens as f64 * per_token),
        "modules' FLOPs {total} against the engine's {}",
        tokens as f64 * per_token
    );
    assert_eq!(model.params, param_count, "parameters");
    for m in tree.iter().filter(|m| m.depth() < 3) {
        let kids = children(tree, &m.path);
        if kids.is_empty() {
            continue;
        }
        let sum = |f: fn(&ModuleProfile) -> f64| kids.iter().map(|k| f(k)).sum::<f64>();
        assert!(
            close(sum(|k| k.forward_flops), m.forward_flops),
            "{}",
            m.path
        );
        assert!(
            close(sum(|k| k.backward_flops), m.backward_flops),
            "{}",
            m.path
        );
        assert_eq!(
            kids.iter().map(|k| k.params).sum::<u64>(),
            m.params,
            "{}",
            m.path
        );
        // A module's clock runs while its parts' do (a block's also
        // between them; the model's also waits for gathers).
        for (what, f) in [
            (
                "forward",
                (|k: &ModuleProfile| k.forward_ms) as fn(&ModuleProfile) -> f64,
            ),
            ("backward", |k| k.backward_ms),
            ("recompute", |k| k.recompute_ms),
        ] {
            let (parts, whole) = (sum(f), f(m));
            let slack = if m.path == "model" { 0.0 } else { 1e-6 };
            assert!(
                parts <= whole + slack,
                "{}: {what} parts {parts} ms, whole {whole} ms",
                m.path
            );
        }
    }
}

/// GPT with activation checkpointing: every block has its norms, its
/// attention's three parts and its MLP's two products (GELU runs inside
/// the first, as the products' epilogue), in forward order; the blocks
/// recompute their forward in backward, and the recomputation is timed.
#[test]
fn a_gpt_step_is_accounted_module_by_module() {
    let spec = typed_spec("f32", 0, 2, 2000, true, true, 2);
    let (tree, tokens, per_token) = profiled(&spec);
    let count = zmodel::Gpt::new(&spec.model).unwrap().param_count() as u64;
    check_sums(&tree, tokens, per_token, count);
    let want: Vec<String> = ["model", "embedding"]
        .into_iter()
        .map(String::from)
        .chain((0..2).flat_map(|b| {
            [
                "",
                ".ln_1",
                ".attn",
                ".attn.c_attn",
                ".attn.attention",
                ".attn.c_proj",
                ".ln_2",
                ".mlp",
                ".mlp.c_fc",
                ".mlp.c_proj",
            ]
            .map(|p| format!("h.{b}{p}"))
        }))
        .chain(["head".to_string()])
        .collect();
    assert_eq!(paths(&tree), want);
    for b in 0..2 {
        let block = row(&tree, &format!("h.{b}"));
        assert!(
            block.forward_ms > 0.0 && block.backward_ms > 0.0,
            "{block:?}"
        );
        assert!(
            block.recompute_ms > 0.0,
            "checkpointing recomputes: {block:?}"
        );
        let attention = row(&tree, &format!("h.{b}.attn.attention"));
        assert_eq!(attention.params, 0);
        // 4·d·T forward a token, twice that backward.
        let d = spec.model.d_model as f64;
        let t = spec.model.seq_len as f64;
        assert!(close(attention.forward_flops, 4.0 * d * t * tokens as f64));
        assert!(close(
            attention.backward_flops,
            2.0 * attention.forward_flops
        ));
    }
    // The head runs forward and backward in one pass, counted as backward.
    let head = row(&tree, "head");
    assert!(head.forward_ms == 0.0 && head.backward_ms > 0.0, "{head:?}");
}

/// A Qwen3-like LLaMA (q/k norms, rotary) at stage 3 with the embedding
/// and the first block frozen: backward stops above them, so the first
/// block's backward FLOPs are none and the frozen parameters' gradient
/// products are left out, as the metrics' figure leaves them.
#[test]
fn frozen_layers_and_a_llamas_parts_are_accounted() {
    let yaml = "model: {kind: llama, vocab_size: 64, d_model: 32, n_layers: 3, n_heads: 4, n_kv_heads: 2, seq_len: 16, qk_norm: true}\n\
         data: {format: synthetic}\n\
         train: {steps: 2, micro_batch_size: 4, lr: 3.0e-3, freeze: [\"embed_tokens.weight\", \"layers.0.*\", \"layers.1.mlp.*\"]}\n\
         zero: {stage: 3, prefetch_bucket_size: 3000, param_persistence_threshold: 100}\n";
    let spec: JobSpec = yaml.parse().unwrap();
    let (tree, tokens, per_token) = profiled(&spec);
    let count = zmodel::Gpt::new(&spec.model).unwrap().param_count() as u64;
    check_sums(&tree, tokens, per_token, count);
    for p in [
        "layers.2.input_layernorm",
        "layers.2.self_attn.qkv_proj",
        "layers.2.self_attn.qk_norm",
        "layers.2.self_attn.rotary_emb",
        "layers.2.self_attn.attention",
        "layers.2.self_attn.o_proj",
        "layers.2.post_attention_layernorm",
        "layers.2.mlp.gate_up_proj",
        "layers.2.mlp.act_fn",
        "layers.2.mlp.down_proj",
    ] {
        row(&tree, p);
    }
    let first = row(&tree, "layers.0");
    assert_eq!(first.backward_flops, 0.0, "backward stops above block 0");
    assert_eq!(first.backward_ms, 0.0);
    // Block 1's MLP is frozen: its backward makes the input gradient only.
    let mlp = row(&tree, "layers.1.mlp.down_proj");
    assert!(close(mlp.backward_flops, mlp.forward_flops), "{mlp:?}");
    let attn = row(&tree, "layers.1.self_attn.o_proj");
    assert!(
        close(attn.backward_flops, 2.0 * attn.forward_flops),
        "{attn:?}"
    );
}
