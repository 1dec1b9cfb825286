"""Test doubles for things that cannot run here: TensorRT-LLM's executor bindings and LLM API.

They reproduce the behaviour read in upstream source (each double's docstring names the files
and releases) so that the TensorRT-LLM engines can be tested through the real core and gRPC on
loopback.
"""
