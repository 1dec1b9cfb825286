# A Trellis gateway (LMI, OpenAI, Triton or WebSocket): the gateway island only, no torch.
#   docker build -f deploy/docker/gateway.Dockerfile -t trellis-gateway .
#   docker run -p 8000:8000 trellis-gateway openai --host 0.0.0.0 --core dns:///trellis-core:50051
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY envflags ./envflags
COPY logclip ./logclip
COPY servegc ./servegc
COPY servestop ./servestop
COPY oteltrace ./oteltrace
COPY core ./core
COPY gateways ./gateways
COPY gen ./gen
# The gateway extra only (aiohttp, pydantic, prometheus-client, grpcio): torch and transformers
# are the core's and stay out, as `make gateway-check` asserts for the same install.
RUN pip install ".[gateway]" && rm -rf /src && useradd --create-home --uid 10001 trellis
WORKDIR /home/trellis
USER trellis
# 8080 LMI, 8000 OpenAI, 8001 Triton, 8765 WebSocket (each gateway's default port).
EXPOSE 8000 8001 8080 8765
ENTRYPOINT ["trellis-gateway"]
CMD ["openai", "--host", "0.0.0.0"]
