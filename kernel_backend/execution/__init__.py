"""Where jobs run: the executor the service holds, and what stands behind it.

executor.py is the one interface (start, submit, stats, report) and its in-process implementation; the
scheduler thread that owns the engines (scheduler.py); a job's engine-side work as plain data, and the functions
that do it (engine_work.py); the sample jobs the in-process executor sends to vLLM instead (vllm_sampler.py, with
STEPWISE_SAMPLER=vllm); the Ray cluster that runs the same on engine workers (cluster.py, the gateway;
cluster_worker.py, the worker).

Imports engine/, vllm/ and persistence/; never service/ or api/.
"""
