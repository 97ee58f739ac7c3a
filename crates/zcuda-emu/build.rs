//! Compiles `kernels/gpt.cu` and `quantize.cu`, and `kernels/reduce.cu`,
//! `adamw.cu` and `attention.cu` each after `half16.cuh` as zcuda compiles them, as C++ for the CPU (see `cpp/emu.h`): their
//! kernels lose `extern "C"` and go into namespaces, so that only the
//! launchers of `cpp/emu.cpp` are exported. Sets `cfg(emulator)` when that
//! worked; a machine without a C++20 compiler builds the rest, and the
//! tests skip saying why.

use std::path::PathBuf;

fn main() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    let read = |f: &str| {
        std::fs::read_to_string(root.join("../../kernels").join(f))
            .unwrap_or_else(|e| panic!("kernels/{f}: {e}"))
    };
    for (name, cuda) in [
        ("gpt_kernels.cu", read("gpt.cu")),
        ("reduce_kernels.cu", read("half16.cuh") + &read("reduce.cu")),
        ("adamw_kernels.cu", read("half16.cuh") + &read("adamw.cu")),
        ("quantize_kernels.cu", read("quantize.cu")),
        (
            "attention_kernels.cu",
            read("half16.cuh") + &read("attention.cu"),
        ),
    ] {
        std::fs::write(
            out.join(name),
            cuda.replace("extern \"C\" __global__", "__global__"),
        )
        .expect("writing the kernels for C++");
    }
    println!("cargo::rustc-check-cfg=cfg(emulator)");
    let built = cc::Build::new()
        .cpp(true)
        .std("c++20")
        .file(root.join("cpp/emu.cpp"))
        .file(root.join("cpp/emu_fiber.cpp"))
        .include(&out)
        .include(root.join("cpp"))
        // NVRTC compiles zrun's kernels with --fmad=false: no FMA here either.
        .flag("-ffp-contract=off")
        .flag("-pthread")
        .warnings(false)
        .cargo_warnings(false)
        .try_compile("zcuda_emu");
    // Without a C++20 compiler the workspace still builds; the tests say
    // they skipped, and CI (ZRUN_REQUIRE_EMULATOR=1) fails instead.
    match built {
        Ok(()) => println!("cargo:rustc-cfg=emulator"),
        Err(e) => {
            let why = e.to_string().replace('\n', " ");
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
        "../../kernels/gpt.cu",
        "../../kernels/half16.cuh",
        "../../kernels/reduce.cu",
        "../../kernels/adamw.cu",
        "../../kernels/quantize.cu",
        "../../kernels/attention.cu",
    ] {
        println!("cargo:rerun-if-changed={}", root.join(f).display());
    }
}
