"""TensorRT-LLM engines, laid out after TensorRT-LLM's own parts.

  * `bindings`   : importing `tensorrt_llm.bindings.executor` / the LLM API, and feature
                   detection of the installed release (names and fields changed often);
  * `engine_dir` : the engine directory and the `trellis-engine.json` manifest;
  * `options`    : our `--trt-*` options, typed, and the one mapping from them to upstream
                   config objects (`ExecutorConfig`, `LLM(...)` keywords);
  * `defaults`   : TensorRT-LLM's sampling defaults (pure);
  * `mapping`    : pure request/response mapping (SamplingConfig keywords, stop words,
                   errors, logprobs);
  * `sequence`   : the per-sequence state machine both engines share;
  * `executor`   : `--engine trtllm` over the C++ executor;
  * `llm`        : `--engine trtllm-llm` over the LLM API.

Nothing here imports TensorRT-LLM at import time; the engine factories do, and fail with a
message naming the `trtllm` extra when it is missing.
"""
