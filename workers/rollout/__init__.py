"""The rollout side: lease a task, generate its completions with an engine, score them, hand them back."""
