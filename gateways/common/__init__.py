"""What the gateways share, and the only gateway code they share: the gateway contract and app
factory with the error middleware (app), configuration (config), the core client, the
gRPC-to-HTTP status table and GatewayError (status), wire framing, shape and type helpers for
the schemas (schema), the field tables used both ways (fields), the streaming I/O: first-message
rule, relay loop and fan-in (streaming), and the chat completions schema the OpenAI and LMI
gateways both speak (chat). Nothing here imports a gateway."""
