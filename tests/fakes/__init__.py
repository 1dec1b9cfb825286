"""Test doubles for things that cannot run here: TensorRT-LLM's executor bindings and LLM API.

They reproduce the documented behaviour in `shared/reference/trtllm-executor.md` (§8 lists it)
so that the TensorRT-LLM engines can be tested through the real core and gRPC on loopback.
"""
