"""mortal.client.cli: `mortalctl`, the kubectl-like command line (entry point: main.main).

A module per verb group (apply, get, describe, scale, lifecycle, fork, cp, ops, ...), each a thin verb: it
parses its arguments, calls the client's library (mortal.client.apply, .fork, ...) and prints. Shared by
the verbs: context (global options, store, errors), output and text (what is printed, made safe), and
follow (the live view, which MortalTrainer shows too).
"""
