"""mortal.client.cli: `mortalctl`, the kubectl-like command line (entry point: main.main).

One module per verb group: apply, get, describe, scale, lifecycle (delete/suspend/resume), ops
(logs/controller/schema/version); context (global options, store, errors), output (tables, YAML,
JSON, ages) and follow (the live view shared with MortalTrainer). The top layer: it may import
every other part of mortal, and nothing imports it except mortal.client.trainer.
"""
