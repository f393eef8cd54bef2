"""The client: everything between a notebook (or script) and a backend, and nothing about training or widgets.

- connect:        workbench.connect(): find or start the local backend, or bind to one by URL; budgets
- connection:     the Connection (a backend's URL and key) and the backend's HTTP API beyond the SDK
- local_backend:  the embedded backend a laptop's notebooks share: started, found, stopped
- sdk_hooks:      what connect() adds to the tinker SDK's clients (custom losses reach the ledger, ...)
- past_steps:     fork, sampler_at, undo: go back to any step of a run
- in_thread:      long work awaited in a cell, so the notebook stays live while it runs
- widget_states:  the kernel's answer to a reloaded page, made safe from threads that make widgets

Layering (tests/test_layout.py, docs/architecture.md "The map"): the client imports nothing from
workbench.recipes, workbench.widgets or workbench.lab at module level; the recipes build on it, the
widgets on both.
"""
