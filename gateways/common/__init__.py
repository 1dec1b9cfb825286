"""Shared gateway machinery: configuration, the core client, the gRPC-to-HTTP status table,
wire framing, shape and type helpers for the schemas, the first-message streaming rule with the
relay loop of streamed responses, and the aiohttp app/server helpers."""
