"""OpenAI chat completions, the schema two gateways speak: the OpenAI gateway on
`/v1/chat/completions`, the LMI gateway on `/invocations` for bodies with `messages` (seed
`lmi-chat-completions-schema.md`). Its modules follow a gateway's layout: `schema` (request
shapes and types), `translate` (pure mapping, field and finish-reason tables), `errors` (OpenAI's
error object), `route` (the shared handler)."""
