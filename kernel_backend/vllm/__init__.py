"""vLLM's side of sampling through vLLM (STEPWISE_SAMPLER=vllm): its own venv and the worker in it.

venv.py builds the venv once per machine from requirements/<flavor>.txt; worker.py runs in it, imports nothing
of Stepwise, and serves execution/vllm_sampler.py over a pipe.

Imports config and venvs.py only.
"""
