#!/usr/bin/env bash
# Lint and format-check the contract, then regenerate the Python stubs under gen/python.
# Usage: scripts/gen_proto.sh [--check]   (--check: fail if the committed stubs differ)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
OUT=gen/python

buf lint
buf format --diff --exit-code

if [[ "${1:-}" == "--check" ]]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  OUT_DIR="$tmp"
else
  OUT_DIR="$OUT"
fi

find "$OUT_DIR/trellis" -name '*_pb2*.py*' -delete 2>/dev/null || true
mkdir -p "$OUT_DIR/trellis/generate/v1"
"$PY" -m grpc_tools.protoc -I proto \
  --python_out="$OUT_DIR" --pyi_out="$OUT_DIR" --grpc_python_out="$OUT_DIR" \
  proto/trellis/generate/v1/*.proto

if [[ "${1:-}" == "--check" ]]; then
  for f in "$OUT_DIR"/trellis/generate/v1/*_pb2*; do
    rel=${f#"$OUT_DIR"/}
    if ! cmp -s "$f" "$OUT/$rel"; then
      echo "generated code is stale: $OUT/$rel differs from a fresh regeneration (run 'make proto')" >&2
      exit 1
    fi
  done
  extra=$(comm -13 <(cd "$OUT_DIR" && ls trellis/generate/v1/*_pb2* | sort) <(cd "$OUT" && ls trellis/generate/v1/*_pb2* | sort))
  if [[ -n "$extra" ]]; then
    echo "stale generated files without a proto: $extra" >&2
    exit 1
  fi
  echo "generated code is up to date"
fi
