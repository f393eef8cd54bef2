"""What outlives the process: the database and the files.

database.py (the SQLAlchemy tables: sessions, runs, samplers, futures, checkpoints, usage, keys, audit),
checkpoint_storage.py (checkpoint files, local or any fsspec URL, sealed by crypto.py), api_keys.py (keys,
hashed) and signing.py (JWTs).

Imports config, errors and types; never engine/, execution/, service/ or api/.
"""
