"""Generated gRPC contract of Trellis (never edited by hand; see scripts/gen_proto.sh)."""
