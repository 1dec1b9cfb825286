"""Shared gateway machinery: configuration, the core client, the gRPC-to-HTTP status table,
wire framing, the first-message streaming rule, and the aiohttp app/server helpers."""
