"""The test executable cargo built for one target of one package, or the
folder of zcuda-emu's CPU "GPU" libraries (libcuda.so and the rest).

    python3 scripts/test_exe.py PACKAGE-FOLDER TARGET-NAME ARTIFACTS.json
    python3 scripts/test_exe.py --emulated-gpu ARTIFACTS.json

ARTIFACTS.json is what `cargo test --no-run --message-format=json-...`
printed; PACKAGE-FOLDER the package's folder name (`zcuda`, `tests`), TARGET-NAME
the test target's name (`zcuda` for a library's unit tests, `gpu` for
tests/gpu.rs). Used by check-cuda.sh and gpu-pack.sh.
"""
import json
import sys

if sys.argv[1] == "--emulated-gpu":
    for line in open(sys.argv[2]):
        m = json.loads(line)
        if (m.get("reason") == "build-script-executed"
                and "/crates/zcuda-emu#" in m["package_id"]):
            print(m["out_dir"] + "/gpu")
            sys.exit(0)
    sys.exit("no build of zcuda-emu among the artifacts")

folder, name, artifacts = sys.argv[1:]
for line in open(artifacts):
    m = json.loads(line)
    if (m.get("reason") == "compiler-artifact" and m.get("executable")
            and m["profile"]["test"] and m["target"]["name"] == name
            and m["manifest_path"].endswith("/" + folder + "/Cargo.toml")):
        print(m["executable"])
        break
else:
    sys.exit(f"no test executable {name} in {folder}")
