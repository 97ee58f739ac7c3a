"""The test executable cargo built for one target of one package.

    python3 scripts/test_exe.py PACKAGE-FOLDER TARGET-NAME ARTIFACTS.json

ARTIFACTS.json is what `cargo test --no-run --message-format=json-...`
printed; PACKAGE-FOLDER the package's folder name (`zcuda`, `tests`), TARGET-NAME
the test target's name (`zcuda` for a library's unit tests, `gpu` for
tests/gpu.rs). Used by check-cuda.sh and gpu-pack.sh.
"""
import json
import sys

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
