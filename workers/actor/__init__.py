"""The actor side: TRL's GRPOTrainer trained on the rollouts that rollout workers generate and score."""
