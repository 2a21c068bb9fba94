"""mortal.client: the client layer, what a user drives mortal through.

    cli/                  `mortalctl`, the kubectl-like command line (thin verbs)
    trainer.py            MortalTrainer, the TRL-style Python API (re-exported by the `mortal` facade)
    fork.py, rollback.py, apply.py, checkpoint_copy.py, local_controller.py
                          what the verbs and MortalTrainer both call
    modal_app.py          the Modal deployment's composition root (`modal deploy -m mortal.client.modal_app`)

It writes desired state to the store and reads status back. It may import every other layer (specs,
state, controller, workers); none of them imports it (tests/test_layers.py).
"""
