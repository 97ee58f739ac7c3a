//! Compiles `kernels/quantize.cu`, and `kernels/gpt.cu`, `reduce.cu`,
//! `adamw.cu` and `attention.cu` each after `half16.cuh` (and `runs.cuh`
//! for `reduce.cu` and `adamw.cu`, `dropout.cuh` for `gpt.cu` and
//! `attention.cu`) as zcuda compiles them, as C++ for the CPU (see `cpp/emu.h`): their kernels lose
//! `extern "C"` and go into namespaces, so that only the launchers of
//! `cpp/emu.cpp` are exported. From the same objects it links the CPU
//! "GPU" (`cpp/driver.cpp`, `cublas.cpp`, `nvrtc.cpp`) as shared libraries
//! named as NVIDIA's. Sets `cfg(emulator)` when that worked; a machine
//! without a C++20 compiler builds the rest, and the tests skip saying why.

use std::path::{Path, PathBuf};

fn main() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    let read = |f: &str| {
        std::fs::read_to_string(root.join("../../kernels").join(f))
            .unwrap_or_else(|e| panic!("kernels/{f}: {e}"))
    };
    for (name, cuda) in [
        (
            "gpt_kernels.cu",
            read("half16.cuh") + &read("dropout.cuh") + &read("gpt.cu"),
        ),
        (
            "reduce_kernels.cu",
            read("half16.cuh") + &read("runs.cuh") + &read("reduce.cu"),
        ),
        (
            "adamw_kernels.cu",
            read("half16.cuh") + &read("runs.cuh") + &read("adamw.cu"),
        ),
        ("quantize_kernels.cu", read("quantize.cu")),
        (
            "attention_kernels.cu",
            read("half16.cuh") + &read("dropout.cuh") + &read("attention.cu"),
        ),
    ] {
        std::fs::write(
            out.join(name),
            cuda.replace("extern \"C\" __global__", "__global__"),
        )
        .expect("writing the kernels for C++");
    }
    println!("cargo::rustc-check-cfg=cfg(emulator)");
    println!("cargo:rerun-if-env-changed=ZCUDA_EMU_TSAN");
    // Without a C++20 compiler the workspace still builds; the tests say
    // they skipped, and CI (ZRUN_REQUIRE_EMULATOR=1) fails instead.
    match build(&root, &out) {
        Ok(gpu_dir) => {
            println!("cargo:rustc-cfg=emulator");
            println!("cargo:rustc-env=ZCUDA_EMU_GPU_DIR={}", gpu_dir.display());
        }
        Err(why) => {
            let why = why.replace('\n', " ");
            println!("cargo:rustc-env=ZCUDA_EMU_MISSING={why}");
            println!(
                "cargo:warning=zcuda-emu: no C++20 compiler, the GPU kernels' CPU tests will skip: {why}"
            );
        }
    }
    for f in [
        "cpp/emu.cpp",
        "cpp/emu.h",
        "cpp/emu_fiber.h",
        "cpp/emu_fiber.cpp",
        "cpp/driver.cpp",
        "cpp/cublas.cpp",
        "cpp/nvrtc.cpp",
        "cpp/nccl.cpp",
        "../../kernels/gpt.cu",
        "../../kernels/half16.cuh",
        "../../kernels/dropout.cuh",
        "../../kernels/runs.cuh",
        "../../kernels/reduce.cu",
        "../../kernels/adamw.cu",
        "../../kernels/quantize.cu",
        "../../kernels/attention.cu",
    ] {
        println!("cargo:rerun-if-changed={}", root.join(f).display());
    }
}

/// Compiles the emulation: `libzcuda_emu.a` (the kernels and their
/// launchers, for this crate's tests) and, in `OUT_DIR/gpu`, the CPU
/// "GPU"'s `libcuda.so` (the kernels again, behind the driver API),
/// `libcublas.so`, `libnvrtc.so.12` and `libnccl.so`, whose directory it
/// returns.
fn build(root: &Path, out: &Path) -> Result<PathBuf, String> {
    let mut cc = cc::Build::new();
    cc.cpp(true)
        .std("c++20")
        .include(out)
        .include(root.join("cpp"))
        // NVRTC compiles zrun's kernels with --fmad=false: no FMA here either.
        .flag("-ffp-contract=off")
        .flag("-pthread")
        // TLS descriptors: a thread-local look-up in libcuda.so (opened
        // with dlopen) costs a load, not a call to __tls_get_addr.
        .flag_if_supported("-mtls-dialect=gnu2")
        .pic(true)
        .warnings(false)
        .cargo_warnings(false);
    // ThreadSanitizer over the kernels (cpp/emu_fiber.h: every race between
    // two threads of a block, whatever order they run in here).
    let tsan = std::env::var("ZCUDA_EMU_TSAN").is_ok_and(|v| v == "1");
    if tsan {
        cc.flag("-fsanitize=thread").flag("-g");
    }
    for f in ["emu", "emu_fiber", "driver", "cublas", "nvrtc", "nccl"] {
        cc.file(root.join(format!("cpp/{f}.cpp")));
    }
    let objects = cc.try_compile_intermediates().map_err(|e| e.to_string())?;
    let object = |name: &str| -> Result<PathBuf, String> {
        objects
            .iter()
            .find(|o| {
                o.file_name()
                    .is_some_and(|f| f.to_string_lossy().ends_with(&format!("{name}.o")))
            })
            .cloned()
            .ok_or_else(|| format!("cc made no object for cpp/{name}.cpp"))
    };
    let run = |mut cmd: std::process::Command| -> Result<(), String> {
        let shown = format!("{cmd:?}");
        let done = cmd.output().map_err(|e| format!("{shown}: {e}"))?;
        if done.status.success() {
            Ok(())
        } else {
            Err(format!(
                "{shown}: {}",
                String::from_utf8_lossy(&done.stderr)
            ))
        }
    };
    let archive = out.join("libzcuda_emu.a");
    let _ = std::fs::remove_file(&archive);
    let mut ar = cc.get_archiver();
    ar.arg("crs")
        .arg(&archive)
        .arg(object("emu")?)
        .arg(object("emu_fiber")?);
    run(ar)?;
    println!("cargo:rustc-link-search=native={}", out.display());
    println!("cargo:rustc-link-lib=static=zcuda_emu");
    println!("cargo:rustc-link-lib=dylib=stdc++");
    if tsan {
        println!("cargo:rustc-link-lib=dylib=tsan");
    }

    let gpu = out.join("gpu");
    let _ = std::fs::remove_dir_all(&gpu); // no library of an earlier build stays
    std::fs::create_dir_all(&gpu).map_err(|e| format!("{}: {e}", gpu.display()))?;
    let compiler = cc.get_compiler();
    for (lib, parts) in [
        ("libcuda.so", &["driver", "emu", "emu_fiber"][..]),
        ("libcublas.so", &["cublas"][..]),
        // NVRTC by its versioned name only, so that a real one on the
        // library path (NVIDIA's wheel ships libnvrtc.so.12) is found
        // first where there is one.
        ("libnvrtc.so.12", &["nvrtc"][..]),
        // The collectives tell libcuda's stream when it is busy.
        ("libnccl.so", &["nccl"][..]),
    ] {
        let mut link = compiler.to_command();
        if tsan {
            link.arg("-fsanitize=thread");
        }
        link.arg("-shared")
            .arg("-pthread")
            .arg(format!("-Wl,-soname,{lib}"));
        for p in parts {
            link.arg(object(p)?);
        }
        if lib == "libnccl.so" {
            link.arg(format!("-L{}", gpu.display()))
                .arg("-lcuda")
                .arg("-lrt")
                .arg("-Wl,-rpath,$ORIGIN");
        }
        link.arg("-o").arg(gpu.join(lib));
        run(link)?;
    }
    Ok(gpu)
}
