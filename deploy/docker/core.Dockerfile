# The Trellis core (gRPC on 50051). The default build is the CPU image (HF engine, mock engine);
# for TensorRT-LLM build on NVIDIA's release image, which brings CUDA, torch and tensorrt_llm:
#   docker build -f deploy/docker/core.Dockerfile -t trellis-core .
#   docker build -f deploy/docker/core.Dockerfile -t trellis-core:trtllm \
#     --build-arg BASE=nvcr.io/nvidia/tensorrt-llm/release:1.2.0 --build-arg TORCH=preinstalled .
#   docker run -v $PWD/models/demo:/models/demo -p 50051:50051 trellis-core --model /models/demo
ARG BASE=python:3.11-slim
FROM ${BASE}
ARG TORCH=cpu

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 HF_HUB_OFFLINE=1 \
    TRELLIS_CORE_HOST=0.0.0.0
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
# torch first, from its CPU index: as a dependency pip would pull the CUDA build (several GB).
RUN if [ "$TORCH" = "cpu" ]; then \
      pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu; \
    fi \
    && pip install ".[core]" && rm -rf /src && useradd --create-home --uid 10001 trellis
WORKDIR /home/trellis
USER trellis
# 50051 gRPC; 9400 Prometheus metrics (TRELLIS_CORE_METRICS_PORT).
EXPOSE 50051 9400
ENTRYPOINT ["trellis-core"]
